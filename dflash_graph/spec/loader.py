"""TOML text to a validated `GraphSpec`. Strict: unknown keys are errors that list the valid keys, and every
error carries the file, the line and the TOML path."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path as FsPath
from typing import Any

from ..errors import GraphError, Location, Problem, did_you_mean
from ..units import canonical_dtype, parse_bytes, parse_rate
from . import schema
from .document import DeviceSpec, GraphSpec, LaunchSpec, MemorySpec, ModelSpec, NodeSpec, frozen_map
from .toml_lines import LineIndex, Path, render_path


def load_graph(path: str | FsPath, overrides: Sequence[str] = ()) -> GraphSpec:
    """Read and validate a graph file. `overrides` are `dotted.path=value` strings (the CLI's --set)."""
    p = FsPath(path)
    fname = str(path)
    if not p.exists():
        raise GraphError(Problem(f"no such file: {fname}", Location(fname), hint="check the path; graphs ship in graphs/"))
    if p.is_dir():
        raise GraphError(Problem(f"{fname} is a directory, not a graph file", Location(fname),
                                 hint=f"pass a .toml file, e.g. {fname.rstrip('/')}/tiny.toml"))
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraphError(Problem(f"not a text file (invalid UTF-8 at byte {e.start})", Location(fname),
                                 hint="a graph is a UTF-8 TOML file")) from None
    return parse_graph(text, fname, base_dir=p.parent, overrides=overrides)


def parse_graph(text: str, file: str | None = None, base_dir: FsPath | None = None,
                overrides: Sequence[str] = ()) -> GraphSpec:
    if "\x00" in text:
        raise GraphError(Problem("not a text file (contains NUL bytes)", Location(file), hint="a graph is a UTF-8 TOML file"))
    if not text.strip():
        raise GraphError(Problem("the file is empty", Location(file),
                                 hint="a graph needs [dims], [devices.<name>] and [[nodes]]; see graphs/tiny.toml"))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        import re

        msg = getattr(e, "msg", str(e))
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        line = getattr(e, "lineno", None) or (int(m.group(1)) if m else None)
        raise GraphError(Problem(f"TOML syntax error: {msg}", Location(file, line),
                                 hint="see https://toml.io for the syntax")) from None
    lines = LineIndex(text)
    return _Builder(raw, file, lines, base_dir or FsPath(".")).build(overrides)


class _Builder:
    def __init__(self, raw: dict, file: str | None, lines: LineIndex, base: FsPath):
        self.raw, self.file, self.lines, self.base = raw, file, lines, base
        self.problems: list[Problem] = []

    def loc(self, path: Path) -> Location:
        return Location(self.file, self.lines.line_of(path), render_path(path))

    def err(self, path: Path, msg: str, **kw) -> None:
        self.problems.append(Problem(msg, self.loc(path), **kw))

    def fail_if_any(self) -> None:
        if self.problems:
            raise GraphError(self.problems)

    # -- keys ------------------------------------------------------------------------------------
    def check_keys(self, table: Any, sec: schema.Section, path: Path) -> dict:
        if not isinstance(table, dict):
            self.err(path, f"expected a table for {sec.name}, got {type(table).__name__}")
            return {}
        for k in table:
            if sec.key(k) is None:
                self.err((*path, k), f"unknown key '{k}' in {sec.name}{did_you_mean(k, sec.key_names)}",
                         hint="valid keys: " + ", ".join(sec.key_names))
        for key in sec.keys:
            if key.required and key.name not in table:
                self.err(path, f"missing required key '{key.name}' in {sec.name}", hint=key.doc)
        out = {}
        for key in sec.keys:
            if key.name in table:
                out[key.name] = self.typed(table[key.name], key, (*path, key.name))
            else:
                out[key.name] = parse_bytes(key.default) if key.kind == "size" and key.default is not None else key.default
        return out

    def typed(self, v: Any, key: schema.Key, path: Path) -> Any:
        kind = key.kind
        ok = {
            "str": isinstance(v, str), "int": isinstance(v, int) and not isinstance(v, bool),
            "float": isinstance(v, (int, float)) and not isinstance(v, bool), "bool": isinstance(v, bool),
            "size": isinstance(v, (str, int)) and not isinstance(v, bool), "table": isinstance(v, dict),
            "list": isinstance(v, list), "list[float]": isinstance(v, list), "list[str]": isinstance(v, list),
            "str|table": isinstance(v, (str, dict)), "list|table": isinstance(v, (list, dict)), "any": True,
        }.get(kind, True)
        if not ok:
            self.err(path, f"'{key.name}' must be {kind}, got {type(v).__name__} {v!r}", hint=key.doc)
            return key.default
        if key.choices and v not in key.choices:
            self.err(path, f"'{key.name}' = {v!r} is not one of: {', '.join(key.choices)}{did_you_mean(str(v), key.choices)}")
            return key.default
        if kind == "size" and v is not None:
            try:
                return parse_bytes(v)
            except ValueError as e:
                self.err(path, str(e))
                return 0
        return v

    # -- sections ---------------------------------------------------------------------------------
    def build(self, overrides: Sequence[str]) -> GraphSpec:
        raw = self.raw
        self.load_model_configs()
        apply_overrides(raw, overrides, self)
        self.fail_if_any()
        top = self.check_keys(raw, schema.TOP, ())
        self.fail_if_any()
        graph = self.check_keys(raw.get("graph", {}), schema.GRAPH, ("graph",))
        dims = self.build_dims(raw.get("dims", {}))
        devices = self.build_devices(raw.get("devices", {}))
        groups = self.build_groups(raw.get("groups", {}) or {}, devices)
        memory = self.check_keys(raw.get("memory", {}), schema.MEMORY, ("memory",))
        launch = self.build_launch(raw.get("launch", {}))
        models = self.build_models(raw.get("models", {}) or {})
        nodes = self.build_nodes(raw.get("nodes", []))
        train = self.check_keys(raw.get("train", {}), schema.TRAIN, ("train",))
        data = self.check_keys(raw["data"], schema.DATA, ("data",)) if "data" in raw else {}
        self.fail_if_any()
        del top
        return GraphSpec(
            file=self.file, name=graph["name"] or (FsPath(self.file).stem if self.file else "graph"),
            description=graph["description"] or "", dims=frozen_map(dims), devices=frozen_map(devices),
            groups=frozen_map(groups), models=frozen_map(models), nodes=tuple(nodes),
            memory=MemorySpec(bool(memory["expandable_segments"]), memory["max_split_size"]),
            train=frozen_map(train), data=frozen_map({**data, "_base": str(self.base)}), lines=self.lines,
            launch=launch,
        )

    def build_launch(self, table: Any) -> LaunchSpec:
        v = self.check_keys(table, schema.LAUNCH, ("launch",))
        if not v:
            return LaunchSpec()
        t = v["stall_timeout"]
        if t is not None and not (isinstance(t, (int, float)) and 0 < t < 86400):
            self.err(("launch", "stall_timeout"), f"stall_timeout must be between 0 and 86400 seconds, got {t!r}",
                     hint="e.g. stall_timeout = 30.0")
            t = 30.0
        return LaunchSpec(v["nccl_memory_per_peer"], float(t), v["backend"])

    def load_model_configs(self) -> None:
        """Replace `config = "file.json"` by the file's content so that --set can reach its keys."""
        models = self.raw.get("models")
        if not isinstance(models, dict):
            return
        for name, m in models.items():
            if isinstance(m, dict) and isinstance(m.get("config"), str):
                f = self.base / m["config"]
                try:
                    cfg = json.loads(f.read_text())
                except FileNotFoundError:
                    self.err(("models", name, "config"), f"config file not found: {f}",
                             hint="paths are relative to the graph file")
                    continue
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    self.err(("models", name, "config"), f"config file {f} is not valid JSON: {e}")
                    continue
                m["config"] = cfg
                m["_config_file"] = str(m.get("_config_file") or f)

    def build_dims(self, dims: Any) -> dict:
        if not isinstance(dims, dict):
            self.err(("dims",), "[dims] must be a table")
            return {}
        for k, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                self.err(("dims", k), f"dim '{k}' must be a positive integer or an expression string, got {v!r}")
            elif isinstance(v, int) and v <= 0:
                self.err(("dims", k), f"dim '{k}' must be positive, got {v}", hint=f"set {k} to a positive integer")
        return dims

    def build_devices(self, devs: Any) -> dict[str, DeviceSpec]:
        out = {}
        if not isinstance(devs, dict) or not devs:
            self.err(("devices",), "at least one device is needed: [devices.<name>] with torch and capacity",
                     hint='[devices.cpu]\ntorch = "cpu"\ncapacity = "16 GiB"')
            return out
        for name, d in devs.items():
            v = self.check_keys(d, schema.DEVICE, ("devices", name))
            if v.get("torch") is not None and not _valid_torch_device(v["torch"]):
                self.err(("devices", name, "torch"), f"'{v['torch']}' is not a torch device",
                         hint="use 'cpu', 'cuda', 'cuda:N' or 'meta'")
            rank, rate = v.get("rank"), None
            if rank is not None and rank < 0:
                self.err(("devices", name, "rank"), f"rank must be 0 or more, got {rank}")
            if v.get("throughput") is not None:
                try:
                    rate = parse_rate(v["throughput"])
                except ValueError as e:
                    self.err(("devices", name, "throughput"), str(e))
            if v.get("capacity") is not None:
                out[name] = DeviceSpec(name, v["torch"] or "cpu", v["capacity"] or 0, v["outside_allocator"] or 0,
                                       rank, rate)
        self.check_ranks(out)
        return out

    def check_ranks(self, devs: Mapping[str, DeviceSpec]) -> None:
        """Either no device declares a rank (one rank per device), or every device does, with ranks 0..R-1."""
        declared = {n: d.rank for n, d in devs.items() if d.rank is not None}
        if not declared:
            return
        missing = [n for n in devs if n not in declared]
        if missing:
            verb = "declares" if len(declared) == 1 else "declare"
            self.err(("devices", missing[0]), f"device '{missing[0]}' has no rank, but "
                     f"{', '.join(sorted(declared))} {verb} one", hint="declare `rank` on every device or on none")
            return
        ranks = sorted(set(declared.values()))
        if ranks != list(range(len(ranks))):
            gap = next(i for i in range(len(ranks) + 1) if i not in ranks)
            self.err(("devices",), f"ranks must be 0..{len(ranks) - 1} with none skipped; rank {gap} owns no device",
                     hint="ranks in use: " + ", ".join(map(str, ranks)))

    def build_groups(self, groups: Any, devices: Mapping) -> dict[str, tuple[str, ...]]:
        out = {}
        for g, members in groups.items():
            if g in devices:
                self.err(("groups", g), f"group '{g}' has the same name as a device")
            if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
                self.err(("groups", g), f"group '{g}' must be a non-empty list of device names")
                continue
            for i, m in enumerate(members):
                if m not in devices:
                    self.err(("groups", g, i), f"unknown device '{m}' in group '{g}'{did_you_mean(m, list(devices))}",
                             hint="devices: " + ", ".join(devices))
            out[g] = tuple(members)
        return out

    def build_models(self, models: Any) -> dict[str, ModelSpec]:
        out = {}
        for name, m in models.items():
            cfg_file = m.pop("_config_file", None) if isinstance(m, dict) else None
            v = self.check_keys(m, schema.MODEL, ("models", name))
            if not isinstance(v.get("config"), dict):
                continue
            try:
                dtype = canonical_dtype(v["dtype"])
            except ValueError as e:
                self.err(("models", name, "dtype"), str(e))
                continue
            shares = v["shares"] or {}
            for comp, target in shares.items():
                if not isinstance(target, str) or target.count(".") != 1:
                    self.err(("models", name, "shares", comp), f"share '{comp}' must be \"model.component\", got {target!r}")
            fwd = {k: v.get(k) for k in ("attn_implementation", "packing", "linear_kernels") if v.get(k) is not None}
            out[name] = ModelSpec(name, v["arch"], frozen_map(v["config"]), dtype, bool(v["trainable"]), v["weights"],
                                  frozen_map(shares), cfg_file, frozen_map(fwd))
        for name, m in out.items():
            for comp, target in m.shares.items():
                other = target.split(".")[0]
                if other not in out:
                    self.err(("models", name, "shares", comp), f"share '{comp}' refers to unknown model '{other}'"
                             f"{did_you_mean(other, list(out))}", hint="models: " + ", ".join(out))
        return out

    def build_nodes(self, nodes: Any) -> list[NodeSpec]:
        out: list[NodeSpec] = []
        if not isinstance(nodes, list) or not nodes:
            self.err(("nodes",), "the graph has no nodes", hint="add [[nodes]] tables; see graphs/tiny.toml")
            return out
        seen: dict[str, int] = {}
        for i, n in enumerate(nodes):
            v = self.check_keys(n, schema.NODE, ("nodes", i))
            nid = v.get("id")
            if not isinstance(nid, str) or not nid:
                continue
            if not nid.replace("_", "").replace("-", "").isalnum():
                self.err(("nodes", i, "id"), f"node id '{nid}' may only use letters, digits, _ and -")
            if nid in seen:
                self.err(("nodes", i, "id"), f"duplicate node id '{nid}' (first defined at line "
                         f"{self.lines.line_of(('nodes', seen[nid]))})", node=nid, hint="give each node a unique id")
                continue
            seen[nid] = i
            inputs = v["inputs"]
            if isinstance(inputs, list):
                inputs = tuple(inputs)
            else:
                inputs = frozen_map(inputs)
            refs = inputs if isinstance(inputs, tuple) else tuple(inputs.values())
            for j, r in enumerate(refs):
                if not isinstance(r, str) or r.count(".") != 1:
                    key = j if isinstance(inputs, tuple) else list(inputs)[j]
                    self.err(("nodes", i, "inputs", key), f"input must be \"node.output\", got {r!r}", node=nid)
            out.append(NodeSpec(i, nid, v["op"], inputs, frozen_map(v["params"]), v["device"], v["model"]))
        return out


def _valid_torch_device(s: str) -> bool:
    head, _, idx = s.partition(":")
    return head in ("cpu", "cuda", "meta", "mps", "xpu") and (idx == "" or idx.isdigit())


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict, overrides: Sequence[str], b: _Builder | None = None) -> None:
    """`dims.seq=4096`, `models.target.config.hidden_size=64`, `nodes.<id>.params.k=3`, `memory.expandable_segments=true`."""
    for ov in overrides:
        key, sep, val = ov.partition("=")
        loc = Location(b.file if b else None, None, f"--set {ov}")
        if not sep or not key.strip():
            raise GraphError(Problem(f"--set expects KEY=VALUE, got {ov!r}", loc, hint="e.g. --set dims.seq=4096"))
        parts = key.strip().split(".")
        cur: Any = raw
        for i, part in enumerate(parts[:-1]):
            if isinstance(cur, list):
                match = [n for n in cur if isinstance(n, dict) and n.get("id") == part]
                if not match:
                    ids = [n.get("id") for n in cur if isinstance(n, dict)]
                    raise GraphError(Problem(f"--set {key}: no node with id '{part}'{did_you_mean(part, ids)}", loc))
                cur = match[0]
                continue
            if not isinstance(cur, dict):
                raise GraphError(Problem(f"--set {key}: '{'.'.join(parts[:i])}' is not a table", loc))
            if part not in cur:
                if i == 0 and part not in schema.TOP.key_names:
                    raise GraphError(Problem(f"--set {key}: unknown section '{part}'{did_you_mean(part, schema.TOP.key_names)}",
                                             loc, hint="sections: " + ", ".join(schema.TOP.key_names)))
                cur[part] = {}
            cur = cur[part]
        if not isinstance(cur, dict):
            raise GraphError(Problem(f"--set {key}: '{'.'.join(parts[:-1])}' is not a table", loc))
        old = cur.get(parts[-1])
        if isinstance(old, (dict, list)):
            raise GraphError(Problem(f"--set {key}: only scalars can be set, '{key}' is a "
                                     f"{'table' if isinstance(old, dict) else 'list'}", loc))
        cur[parts[-1]] = _parse_scalar(val.strip())
