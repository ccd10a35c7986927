"""TOML text to a validated `GraphSpec`. Strict: unknown keys are errors that list the valid keys, and every
error carries the file, the line and the TOML path."""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path as FsPath
from typing import Any

from ..errors import GraphError, Location, Problem, did_you_mean, short
from ..units import canonical_dtype, parse_bandwidth, parse_bytes, parse_rate
from . import schema
from .document import DeviceSpec, GraphSpec, LaunchSpec, MemorySpec, ModelSpec, NodeSpec, frozen_map
from .toml_lines import LineIndex, Path, render_path


# NOTE [Input bounds]: `check` answers every input in about a second, so what it reads is bounded, each bound
# refused with a message naming it: a graph file of at most 16 MiB (the 27B graph is 12 KiB), values nested at
# most 32 deep (graphs nest 5 deep; a model config.json 3), numbers at most 2**63 in magnitude and finite.
MAX_FILE_BYTES = 16 * 2**20
MAX_DEPTH = 32
MAX_INT = 2**63


def load_graph(path: str | FsPath, overrides: Sequence[str] = ()) -> GraphSpec:
    """Read and validate a graph file. `overrides` are `dotted.path=value` strings (the CLI's --set)."""
    fname = str(path)
    if "\x00" in fname:
        raise GraphError(Problem(f"the path {fname!r} contains a NUL byte", Location(fname.replace("\x00", "\\0")),
                                 hint="check the path; graphs ship in graphs/"))
    p = FsPath(path)
    if not p.exists():
        raise GraphError(Problem(f"no such file: {fname}", Location(fname), hint="check the path; graphs ship in graphs/"))
    if p.is_dir():
        raise GraphError(Problem(f"{fname} is a directory, not a graph file", Location(fname),
                                 hint=f"pass a .toml file, e.g. {fname.rstrip('/')}/tiny.toml"))
    if p.stat().st_size > MAX_FILE_BYTES:
        raise GraphError(Problem(f"the file is {p.stat().st_size:,} bytes, over the bound of {MAX_FILE_BYTES:,} "
                                 "(16 MiB) for a graph", Location(fname), hint="is this a graph file?"))
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
    if len(text) > MAX_FILE_BYTES:
        raise GraphError(Problem(f"the text is {len(text):,} characters, over the bound of {MAX_FILE_BYTES:,} for a "
                                 "graph", Location(file)))
    lines = LineIndex(text)      # linear in the text, on any text; measures the nesting before tomllib recurses
    if lines.max_depth > MAX_DEPTH:
        raise GraphError(Problem(f"values nest {lines.max_depth} deep, over the bound of {MAX_DEPTH}",
                                 Location(file, lines.deepest_line), hint="a graph nests tables and arrays a few "
                                 "levels deep; see graphs/tiny.toml"))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = getattr(e, "msg", str(e))
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        line = getattr(e, "lineno", None) or (int(m.group(1)) if m else None)
        raise GraphError(Problem(f"TOML syntax error: {msg}", Location(file, line),
                                 hint="see https://toml.io for the syntax")) from None
    except ValueError as e:   # int() refuses more than 4,300 digits (sys.get_int_max_str_digits)
        m = re.search(r"[0-9_]{4000,}", text)
        line = text.count("\n", 0, m.start()) + 1 if m else None
        raise GraphError(Problem(f"a number too long to read ({e.__class__.__name__}: {str(e).split(';')[0]})",
                                 Location(file, line), hint=f"numbers in a graph are at most 2**63 in magnitude")) from None
    except RecursionError:
        raise GraphError(Problem(f"values nest too deeply to read (the bound is {MAX_DEPTH})", Location(file),
                                 hint="a graph nests tables and arrays a few levels deep")) from None
    return _Builder(raw, file, lines, base_dir or FsPath(".")).build(overrides)


class _Builder:
    def __init__(self, raw: dict, file: str | None, lines: LineIndex, base: FsPath):
        self.raw, self.file, self.lines, self.base = raw, file, lines, base
        self.problems: list[Problem] = []

    def loc(self, path: Path) -> Location:
        return Location(self.file, self.lines.line_of(path), render_path(path), self.lines.flag_of(path))

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
        if ok and kind == "list[float]":
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            if ok and key.default is not None and len(v) != len(key.default):
                self.err(path, f"'{key.name}' must have {len(key.default)} numbers, got {len(v)}", hint=key.doc)
                return key.default
        if not ok:
            self.err(path, f"'{key.name}' must be {kind}, got {type(v).__name__} {short(v)}", hint=key.doc)
            return key.default
        if key.choices and v not in key.choices:
            self.err(path, f"'{key.name}' = {short(v)} is not one of: {', '.join(key.choices)}"
                     f"{did_you_mean(str(v)[:100], key.choices)}")
            return key.default
        if kind == "size" and v is not None:
            try:
                v = parse_bytes(v)
            except ValueError as e:
                self.err(path, str(e))
                return 0
        for x in (v if kind == "list[float]" else [v]):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not _within(x, key):
                self.err(path, f"'{key.name}' = {short(x)} is out of range: {key.bounds_text()}", hint=key.doc)
                return key.default
        return v

    # -- sections ---------------------------------------------------------------------------------
    def build(self, overrides: Sequence[str]) -> GraphSpec:
        raw = self.raw
        self.load_model_configs()
        self.fail_if_any()
        apply_overrides(raw, overrides, self)
        self.fail_if_any()
        self.check_values(raw)
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
        capture = self.check_keys(raw.get("capture", {}), schema.CAPTURE, ("capture",))
        for key, readers in (("text_key", ("auto", "text", "hf")), ("messages_key", ("auto", "chat", "hf"))):
            fmt = data.get("format")
            if isinstance(raw.get("data"), dict) and key in raw["data"] and fmt not in readers:
                self.err(("data", key), f"[data] format = {fmt!r} never reads {key}: it would be ignored",
                         hint=f"remove {key}, or use a format that reads it: {', '.join(readers)}")
        if data.get("chat_template") is not None and data.get("tokenizer") is None:
            self.err(("data", "chat_template"), "chat_template is read with the tokenizer, and [data] names none: "
                     "it would be ignored", hint='add tokenizer = "..." (the target\'s tokenizer.json or directory)')
        self.fail_if_any()
        del top
        import copy

        return GraphSpec(resolved=copy.deepcopy(raw),
            file=self.file, name=graph["name"] or (FsPath(self.file).stem if self.file else "graph"),
            description=graph["description"] or "", dims=frozen_map(dims), devices=frozen_map(devices),
            groups=frozen_map(groups), models=frozen_map(models), nodes=tuple(nodes),
            memory=MemorySpec(bool(memory["expandable_segments"]), memory["max_split_size"], memory["host_memory"]),
            train=frozen_map(train), data=frozen_map({**data, "_base": str(self.base)}), lines=self.lines,
            launch=launch, capture=frozen_map(capture),
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
        bw = {}
        for key in ("intra_node_bandwidth", "inter_node_bandwidth"):
            try:
                bw[key] = parse_bandwidth(v[key])
            except ValueError as e:
                self.err(("launch", key), str(e), hint=f"e.g. {key} = \"{schema.LAUNCH.key(key).default}\"")
                bw[key] = parse_bandwidth(schema.LAUNCH.key(key).default)
        return LaunchSpec(v["nccl_memory_per_peer"], float(t), v["backend"], **bw)

    def load_model_configs(self) -> None:
        """Replace `config = "file.json"` by the file's content so that --set can reach its keys."""
        models = self.raw.get("models")
        if not isinstance(models, dict):
            return
        for name, m in models.items():
            if isinstance(m, dict) and isinstance(m.get("config"), str):
                path = ("models", name, "config")
                if "\x00" in m["config"]:
                    self.err(path, f"the config path {short(m['config'])} contains a NUL byte")
                    continue
                f = self.base / m["config"]
                try:
                    if f.is_file() and f.stat().st_size > MAX_FILE_BYTES:
                        self.err(path, f"config file {f} is over the bound of 16 MiB for a model config")
                        continue
                    cfg = json.loads(f.read_text())
                except FileNotFoundError:
                    self.err(path, f"config file not found: {f}", hint="paths are relative to the graph file")
                    continue
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    self.err(path, f"config file {f} is not valid JSON: {e}")
                    continue
                except RecursionError:
                    self.err(path, f"config file {f} nests too deeply to read (the bound is {MAX_DEPTH})")
                    continue
                except ValueError as e:   # a number over 4,300 digits
                    self.err(path, f"config file {f} has a number too long to read ({str(e).split(';')[0]})")
                    continue
                except OSError as e:
                    self.err(path, f"cannot read config file {f}: {e.strerror or e}")
                    continue
                if not isinstance(cfg, dict):
                    self.err(path, f"config file {f} holds a JSON {type(cfg).__name__}, not an object of config keys")
                    continue
                m["config"] = cfg
                m["_config_file"] = str(m.get("_config_file") or f)

    def check_values(self, raw: dict) -> None:
        """Every value of the document (config.json files included): nested at most MAX_DEPTH deep, numbers finite
        and at most 2**63 in magnitude, no NUL in a string. Iterative, so any depth is measured, not recursed."""
        todo: list[tuple[Path, Any]] = [((), raw)]
        while todo:
            path, v = todo.pop()
            if len(path) > MAX_DEPTH:
                self.err(path[:3], f"values nest more than {MAX_DEPTH} deep (at {render_path(path[:6])}...)",
                         hint="a graph and a model config nest a few levels deep")
                return
            if isinstance(v, dict):
                todo.extend(((*path, k), x) for k, x in v.items())
            elif isinstance(v, list):
                todo.extend(((*path, i), x) for i, x in enumerate(v))
            elif isinstance(v, float) and not math.isfinite(v):
                self.err(path, f"{render_path(path)} = {v}: a graph's numbers must be finite",
                         hint="write the number itself (nan and inf are never a size, a rate or a factor)")
            elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
                self.err(path, f"{render_path(path)} = {short(v)} is over the bound of 2**63 for a number")
            elif isinstance(v, str) and "\x00" in v:
                self.err(path, f"{render_path(path)} contains a NUL byte", hint="remove the \\u0000 escape")

    def build_dims(self, dims: Any) -> dict:
        if not isinstance(dims, dict):
            self.err(("dims",), "[dims] must be a table")
            return {}
        for k, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                self.err(("dims", k), f"dim '{k}' must be a positive integer or an expression string, got {short(v)}")
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
            if v.get("torch") is not None and not valid_torch_device(v["torch"]):
                self.err(("devices", name, "torch"), f"{short(v['torch'])} is not a torch device",
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
                                       rank, rate, int(v["node"] or 0))
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
            shares = dict(v["shares"] or {})
            for comp, target in list(shares.items()):
                if not isinstance(target, str) or target.count(".") != 1:
                    self.err(("models", name, "shares", comp), f"share '{comp}' must be \"model.component\", got "
                             f"{short(target)}", hint='e.g. shares = { embed = "target.embed" }')
                    del shares[comp]
                elif target.split(".")[0] == name:
                    self.err(("models", name, "shares", comp), f"share '{comp}' = {target!r} refers to model "
                             f"'{name}' itself", hint="a model shares components of another model, e.g. \"target.embed\"")
                    del shares[comp]
            fwd = {k: v.get(k) for k in ("attn_implementation", "packing", "linear_kernels") if v.get(k) is not None}
            if v.get("parallel") is not None and not v["trainable"]:
                self.err(("models", name, "parallel"), f"model '{name}' declares parallel = {v['parallel']!r} but "
                         "is not trainable: only a trained model has gradients to reduce across replicas",
                         expected="trainable = true", actual="trainable = false",
                         hint=f"remove parallel from [models.{name}] (a frozen model on a group is already one "
                              "replica per device), or set trainable = true")
            out[name] = ModelSpec(name, v["arch"], frozen_map(v["config"]), dtype, bool(v["trainable"]), v["weights"],
                                  frozen_map(shares), cfg_file, frozen_map(fwd), v.get("parallel"))
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


def valid_torch_device(s: str) -> bool:
    return re.fullmatch(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,4})?", s, flags=re.ASCII) is not None


def _within(x: float, key: schema.Key) -> bool:
    if isinstance(x, float) and not math.isfinite(x):
        return False
    if key.low is not None and (x < key.low or (key.open_low and x == key.low)):
        return False
    return key.high is None or (x < key.high or (not key.open_high and x == key.high))


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _section_at(path: Path) -> schema.Section | None:
    """The declared section a table path is an instance of (None for free-form tables: dims, groups, a model's
    config, a node's params and inputs)."""
    shape = tuple("<int>" if isinstance(x, int) else x for x in path)
    if shape == ():
        return schema.TOP
    if len(shape) == 1:
        return {"graph": schema.GRAPH, "memory": schema.MEMORY, "launch": schema.LAUNCH, "train": schema.TRAIN, "data": schema.DATA,
                "capture": schema.CAPTURE}.get(shape[0])
    if len(shape) == 2 and shape[0] == "devices":
        return schema.DEVICE
    if len(shape) == 2 and shape[0] == "models":
        return schema.MODEL
    if len(shape) == 2 and shape[0] == "nodes":
        return schema.NODE
    return None


# tables whose keys a --set may add: a declared key of a declared section, a node's param or input (infer checks
# them against the op's declaration), a key of a model's config (infer checks it against the arch's keys)
_OPEN_FOR_SET = (("models", "*", "config"), ("nodes", "*", "params"), ("nodes", "*", "inputs"))


def apply_overrides(raw: dict, overrides: Sequence[str], b: _Builder | None = None) -> dict[Path, str]:
    """`dims.seq=4096`, `models.target.config.hidden_size=64`, `nodes.<id>.params.k=3`, `memory.expandable_segments=true`.

    A --set path must name a key that exists, or one a declared section allows (`train.lr` when [train] is not
    written); a typo gets a did-you-mean, and the flag is recorded as where the value was written, so that any
    later error about it names the flag. Returns the TOML paths set, each with its flag."""
    set_by: dict[Path, str] = {}
    for ov in overrides:
        key, sep, val = ov.partition("=")
        flag = f"--set {ov if len(ov) <= 120 else ov[:100] + f'... ({len(ov):,} characters)'}"
        loc = Location(b.file if b else None, None, None, flag)

        def fail(msg: str, hint: str | None = None):
            raise GraphError(Problem(msg, loc, hint=hint))

        if "\x00" in ov:
            fail("the value contains a NUL byte")
        if not sep or not key.strip():
            fail(f"--set expects KEY=VALUE, got {short(ov)}", hint="e.g. --set dims.seq=4096")
        parts = [x.strip() for x in key.strip().split(".")]
        if any(not x for x in parts):
            fail(f"'{key.strip()}' has an empty part: a key is dotted names, e.g. dims.seq",
                 hint="e.g. --set dims.seq=4096 or --set nodes.loss.params.gamma=4")
        if len(parts) > MAX_DEPTH:
            fail(f"'{short(key, 40)}' is more than {MAX_DEPTH} keys deep")
        cur: Any = raw
        path: Path = ()
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(cur, list):   # [[nodes]] by id
                ids = [n.get("id") for n in cur if isinstance(n, dict)]
                idx = next((j for j, n in enumerate(cur) if isinstance(n, dict) and n.get("id") == part), None)
                if idx is None:
                    fail(f"no node with id '{part}'{did_you_mean(part, [x for x in ids if isinstance(x, str)])}",
                         hint="nodes are named by id: --set nodes.<id>.params.<param>=VALUE")
                if last:
                    fail(f"'{key.strip()}' names a whole node; set one of its keys",
                         hint="e.g. --set nodes." + part + ".device=gpu0")
                cur, path = cur[idx], (*path, idx)
                continue
            if not isinstance(cur, dict):
                fail(f"'{'.'.join(parts[:i])}' is a value, not a table: it has no key '{part}'")
            if part not in cur:
                sec = _section_at(path)
                allowed = sec is not None and sec.key(part) is not None and not sec.open
                allowed = allowed or any(len(pat) == len(path) and all(a in ("*", x) for a, x in zip(pat, path))
                                         for pat in _OPEN_FOR_SET)
                if not allowed:
                    where = render_path(path) or "the top level"
                    have = [str(k) for k in cur] + ([k for k in sec.key_names if k not in cur] if sec else [])
                    fail(f"'{key.strip()}': {where} has no key '{part}'{did_you_mean(part, have)}",
                         hint=("keys: " + ", ".join(have[:40])) if have else None)
                if not last:
                    cur[part] = {}
            if last:
                break
            cur, path = cur[part], (*path, part)
        old = cur.get(parts[-1]) if isinstance(cur, dict) else None
        if isinstance(old, (dict, list)):
            fail(f"only scalars can be set, '{key.strip()}' is a {'table' if isinstance(old, dict) else 'list'}",
                 hint=f"set its keys one by one, e.g. --set {key.strip()}.<key>=VALUE" if isinstance(old, dict) else
                 "a list is changed in the graph file: edit a copy of it")
        if len(val) > 100_000:
            fail(f"the value is {len(val):,} characters, over the bound of 100,000 for a --set value")
        try:
            value = _parse_scalar(val.strip())
        except ValueError as e:   # a number over 4,300 digits
            fail(f"cannot read the value: {str(e).split(';')[0]}")
        except RecursionError:
            fail(f"cannot read the value: it nests too deeply (a --set value is a scalar)")
        if isinstance(value, (dict, list)):
            fail("only scalars can be set (a number, a string, true or false)")
        cur[parts[-1]] = value
        set_by[(*path, parts[-1])] = flag
    if b is not None:
        b.lines.set_by.update(set_by)
    return set_by
