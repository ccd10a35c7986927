"""Targets whose memory is a program derived from transformers' own code: Qwen3, Llama 3, Qwen3-MoE.

Pure Python, no torch: `check` reads these. Every size comes from the arch's stored program
(models/programs/, derived by tools/derive_programs.py from transformers' modules under fake tensors): the
allocations of the forward, in order, and the parameters of each component, as polynomials in the config's dims.
Nothing here knows a family: a family is a registry entry (models/registry.py) and its derived program, and
this module reads that program's dim names, the config keys they come from, and the config values it holds for.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from . import programs
from .body import BodyEvents

PACKINGS = ("documents", "mask")
#: the attention implementations a program is derived for (models/trace/derive.py traces sdpa)
ATTN_IMPLEMENTATIONS = ("sdpa",)
#: bytes per element of the dtype the programs are derived in
PROGRAM_DTYPE_BYTES = {"bfloat16": 2}

#: Config keys transformers' config classes fill in when a config.json leaves them out, where a real checkpoint's
#: config may do so: a value, or the name of another key it copies, or ("div", a, b). The config classes'
#: defaults (transformers 5.24): LlamaConfig head_dim = hidden_size // num_attention_heads; Qwen3Config and
#: Qwen3MoeConfig head_dim = 128; every family num_key_value_heads = num_attention_heads.
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128, "num_key_value_heads": "num_attention_heads"},
    "qwen3_moe": {"head_dim": 128, "num_key_value_heads": "num_attention_heads"},
    "llama": {"head_dim": ("div", "hidden_size", "num_attention_heads"),
              "num_key_value_heads": "num_attention_heads"},
}

#: config keys a derived program's `fixed` values may differ in without changing its allocations: they change
#: only which weights exist (tied embeddings: lm_head reads the embedding's weight)
PARAMS_ONLY = frozenset({"tie_word_embeddings"})


@functools.lru_cache(maxsize=None)
def program(arch: str, packing: str = "documents", fixed: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """The stored program of an arch for a packing (models/programs/), read once. `fixed`: the config's values of
    the keys the program holds for (DecoderDims.fixed, each JSON-encoded) where they are not the packaged
    program's, () where they are; a program derived for them is looked up (`dflash-graph trace-model`)."""
    return programs.load(arch, packing=packing, fixed={k: json.loads(v) for k, v in fixed} if fixed else None)


class NeedsTrace(ValueError):
    """No stored program holds for a config's fixed values: one must be derived for that config, with torch
    (`dflash-graph trace-model`). A ValueError: check reports it at the config's TOML path. `config`: the
    config's file, where the caller knows it (check sets it), written into the command."""

    def __init__(self, arch: str, key: str, value: Any, want: Any, packing: str | None = None):
        super().__init__(arch, key, value, want, packing)
        self.arch, self.key, self.value, self.want, self.packing = arch, key, value, want, packing
        self.config: str | None = None

    def __str__(self) -> str:
        where = self.config or "CONFIG"
        pack = f" --packing {self.packing}" if self.packing else ""
        inline = "" if self.config else " (CONFIG: this model's config written as a config.json)"
        return (f"config key {self.key!r} = {json.dumps(self.value, default=str)}: the packaged {self.arch} memory "
                f"program holds for {self.key} = {json.dumps(self.want)} (transformers runs other code otherwise) "
                f"and none derived for this config is stored{f' (packing {self.packing})' if self.packing else ''}; "
                f"derive one (it needs torch): dflash-graph trace-model {where}{pack}{inline}")


def config_keys(arch: str) -> frozenset[str]:
    """The config keys the program of this arch reads, and those whose values it holds for."""
    p = program(arch)
    return frozenset(k for k in p["dims"].values() if k != "seq") | frozenset(p["fixed"]) | {
        "num_hidden_layers", "layer_types", "tie_word_embeddings"}


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _same(a: Any, b: Any) -> bool:
    """A config value equals a program's fixed value (None and [] both mean "no layers" for a list key)."""
    if isinstance(b, list) and a is None:
        return b == []
    return a == b


@attrs.frozen
class DecoderDims:
    """What check needs of a target whose memory is a derived program: the program's dims read from the config,
    the layers, and how transformers runs the forward (declared on the graph's model)."""

    arch: str
    values: tuple[tuple[str, int], ...]     # program dim name -> value (sorted by name)
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"
    packing: str = "documents"
    # the config's values of the keys the program holds for, JSON-encoded, where they are not the packaged
    # program's (() where they are): which stored program every cost of these dims reads (`program`)
    fixed: tuple[tuple[str, str], ...] = ()

    per_arch = True     # models/registry.py: from_config is told the arch

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.values)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, arch: str) -> DecoderDims:
        """The dims of a config of `arch`, as its program reads them. Bad values raise ValueError naming the key;
        a config whose values make transformers run other code than the program was derived from (another
        layer type, a fixed value changed) is refused, with how to derive a program for it."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"config must be a mapping, got {type(cfg).__name__}")
        p = program(arch)
        defaults = DEFAULTS.get(arch, {})

        def get(key: str) -> Any:
            if cfg.get(key) is not None:
                return cfg[key]
            if key not in defaults:
                raise ValueError(f"config key {key!r} is missing: the {arch} memory program reads it")
            d = defaults[key]
            if isinstance(d, tuple):
                return _positive_int(d[1], get(d[1])) // _positive_int(d[2], get(d[2]))
            return get(d) if isinstance(d, str) else d

        values = {dim: _positive_int(key, get(key)) for dim, key in p["dims"].items() if dim != "seq"}
        n_layers = _positive_int("num_hidden_layers", get("num_hidden_layers"))
        # the keys the program holds for, at the config's values (tied embeddings change only which weights
        # exist: PARAMS_ONLY); where one differs from the packaged program's, a program derived for these values
        # (dflash-graph trace-model) is read instead, and it is the one every cost of these dims reads
        held = {key: (cfg[key] if key in cfg else want) for key, want in p["fixed"].items() if key not in PARAMS_ONLY}
        fixed: tuple[tuple[str, str], ...] = ()
        found = "documents"
        changed = [key for key, want in p["fixed"].items() if key in held and not _same(held[key], want)]
        if changed:
            fixed = tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in held.items()))
            for found in PACKINGS:       # any packing's program has the parameter counts and layer types
                try:
                    p = program(arch, found, fixed)
                    break
                except programs.ProgramError:
                    continue
            else:
                key = changed[0]
                raise NeedsTrace(arch, key, cfg[key], p["fixed"][key])
        tie = cfg.get("tie_word_embeddings", p["fixed"].get("tie_word_embeddings", False))
        if not isinstance(tie, bool):
            raise ValueError(f"config key 'tie_word_embeddings' must be a bool, got {tie!r}")
        known = p["layer_types"]
        if known == ["decoder"]:        # the family has one layer type; a config's layer_types (if any) is moot
            layer_types = ("decoder",) * n_layers
        else:
            lt = cfg.get("layer_types")
            if lt is None:
                layer_types = (known[0],) * n_layers if len(known) == 1 else None
                if layer_types is None:
                    raise ValueError(f"config key 'layer_types' is missing: {arch} has layers of types {known}")
            else:
                if isinstance(lt, (str, bytes)) or not isinstance(lt, (list, tuple)):
                    raise ValueError(f"config key 'layer_types' must be a list, got {lt!r}")
                bad = sorted({t for t in lt if t not in known})
                if bad:
                    raise ValueError(f"config key 'layer_types' has {bad}, and the stored {arch} memory program is "
                                     f"derived for {known} only; derive one for this config: "
                                     f"python tools/derive_programs.py --arch {arch}")
                if len(lt) != n_layers:
                    raise ValueError(f"config key 'layer_types' has {len(lt)} entries but num_hidden_layers is "
                                     f"{n_layers}")
                layer_types = tuple(lt)
        if values["heads"] % values["kv_heads"]:
            raise ValueError(f"config key 'num_key_value_heads' must divide num_attention_heads "
                             f"({values['kv_heads']} does not divide {values['heads']})")
        d = cls(arch=arch, values=tuple(sorted(values.items())), num_hidden_layers=n_layers,
                hidden_size=values["hidden"], vocab_size=values["vocab"], layer_types=layer_types,
                tie_word_embeddings=tie, fixed=fixed, packing=found)
        d._holds(p)
        return d

    def with_forward(self, attn_implementation: str | None, packing: str | None,
                     linear_kernels: str | None) -> DecoderDims:
        """These dims with the forward a graph declares (None: sdpa, documents one by one)."""
        attn = attn_implementation or "sdpa"
        pack = packing or "documents"
        if linear_kernels is not None:
            raise ValueError(f"linear_kernels chooses Gated DeltaNet kernels; {self.arch} has no linear-attention "
                             f"layers: remove it")
        if attn not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation {attn!r}: the stored {self.arch} memory programs are derived for "
                             f"{' and '.join(ATTN_IMPLEMENTATIONS)} (packing documents or mask); declare "
                             f"attn_implementation = \"sdpa\"")
        if pack not in PACKINGS:
            raise ValueError(f"packing must be one of {list(PACKINGS)} for {self.arch}, got {pack!r}")
        d = attrs.evolve(self, attn_implementation=attn, packing=pack)
        try:
            p = program(self.arch, pack, self.fixed)
        except programs.ProgramError:
            if not self.fixed:
                raise
            base = program(self.arch, pack)["fixed"]
            key, value = next((k, json.loads(v)) for k, v in self.fixed if not _same(json.loads(v), base[k]))
            raise NeedsTrace(self.arch, key, value, base[key], pack) from None
        d._holds(p)
        return d

    def _holds(self, p: dict[str, Any]) -> None:
        """Refuse a config where the program's conditions on the dims alone fail (those on seq wait for seq)."""
        values = dict(self.values)
        values.update(programs.derived_values({k: v for k, v in p.get("derived", {}).items()
                                               if "seq" not in v[1:]}, values))
        for cond in p.get("holds_when", ()):
            names = [w for w in cond.split() if w in values or w == "seq"]
            if "seq" in names or programs.holds(cond, values):
                continue
            shown = ", ".join(f"{n} = {values[n]}" + (f" ({p['dims'][n]})" if n in p["dims"] else "")
                              for n in dict.fromkeys(names))
            raise ValueError(f"the stored {self.arch} memory program (packing {p['key']['packing']}) holds when "
                             f"{cond}, and this config has {shown}: transformers runs other code; derive a program "
                             f"for it: python tools/derive_programs.py --arch {self.arch}")

    # -- what the cost code reads (ops/costs.py) -----------------------------------------------------------------
    @property
    def program(self) -> dict[str, Any]:
        return program(self.arch, self.packing, self.fixed)

    def body_events(self, seq: int, dtype_bytes: int) -> BodyEvents:
        return body_events(self, seq, dtype_bytes)

    def body_flops(self, seq: int) -> int:
        return body_flops(self, seq)

    def lm_head_flops(self, tokens: int) -> int:
        return 2 * tokens * self.hidden_size * self.vocab_size

    def body_workspace_bytes(self, seq: int, dtype_bytes: int) -> int:
        """The most bytes the body holds at once besides its embedding output (what a node's workspace means)."""
        _check_dtype(self, dtype_bytes)
        run = programs.evaluate(self.program, self.dims, seq, list(self.layer_types), upto="epilogue")
        return run.peak - seq * self.hidden_size * dtype_bytes

    def norm_program(self, rows: int, dtype_bytes: int, out_bytes: int):
        """The final norm's allocation steps over `rows` rows (ops/costs.py's program form), from the derived
        program's norm piece; None where the input's dtype is not the program's (the op's own formula then)."""
        return norm_program(self, rows, dtype_bytes, out_bytes)


def _check_dtype(d: DecoderDims, dtype_bytes: int) -> None:
    if dtype_bytes not in PROGRAM_DTYPE_BYTES.values():
        have = ", ".join(PROGRAM_DTYPE_BYTES)
        raise ValueError(f"the stored {d.arch} memory programs are derived in {have} ({dtype_bytes}-byte elements "
                         f"asked for): declare dtype = \"bfloat16\" for this model")


def body_events(d: DecoderDims, seq: int, dtype_bytes: int) -> BodyEvents:
    _check_dtype(d, dtype_bytes)
    return program_body_events(d.arch, d.packing, d.values, d.layer_types, seq, d.fixed)


@functools.lru_cache(maxsize=64)
def program_body_events(arch: str, packing: str, dims: tuple[tuple[str, int], ...], layer_types: tuple[str, ...],
                        seq: int, fixed: tuple[tuple[str, str], ...] = ()) -> BodyEvents:
    """The body forward's events (models/body.py) from the arch's derived program: the prologue, each layer type's
    layer, the final norm, and what dies when the body returns (the embedding output, positions, the mask, cos
    and sin, the last layer's output), as transformers' own forward frees them. A steady loop (the delta rule's
    scan over chunks) is written for as many iterations as stand for all (programs.steady_iterations)."""
    p = program(arch, packing, fixed)
    values = programs.bind(p, dict(dims), seq)
    labels: dict[str, str] = {}

    def own(piece: str, prefix: str, out: str | None) -> list[tuple[str, int]]:
        events = []
        for kind, ident, n, label in programs.piece_events(p, values, piece, steady=True):
            name = "h_out" if ident == out else prefix + ident
            if kind == "a":
                labels[name] = label
                events.append(("+" + name, n))
            else:
                events.append(("-" + name, 0))
        return events

    def exports(piece: str) -> list[dict[str, Any]]:
        return p["pieces"][piece]["exports"] if piece in p["pieces"] else []

    def dies_when_body_returns(ex: dict[str, Any], offset: int | None = None) -> bool:
        dies = ex["dies"]
        return dies == {"piece": "epilogue", "at": 0} or (offset is not None and dies == {"offset": offset, "at": 0})

    def unsupported(what: str) -> programs.ProgramError:
        return programs.ProgramError(f"the {arch} program ({p['key']}) has {what}, which the cost code does not "
                                     f"place yet (models/decoder.py body_events)")

    for piece in ("embed", "prologue"):
        for ex in exports(piece):
            if not dies_when_body_returns(ex):
                raise unsupported(f"a {piece} tensor that dies at {ex['dies']}")
    if len(exports("embed")) != 1:
        raise unsupported("an embedding piece that does not hand on exactly one tensor")
    if any(p["pieces"].get(x, {}).get("head") or p["pieces"].get(x, {}).get("tail") or p["pieces"].get(x, {}).get("loop")
           for x in ("between", "epilogue")):
        raise unsupported("code between layers or after the final norm")
    prologue = tuple(own("prologue", "p.", None))
    layers: dict[tuple[str, bool], tuple] = {}
    for t in dict.fromkeys(layer_types):
        ex = exports(f"layer:{t}")
        # a layer hands on its output, which dies once the next layer has run (offset 3: between, the next
        # layer, its between), or when the body returns after the last layer
        if len(ex) != 1 or ex[0]["dies"] != {"offset": 3, "at": 0}:
            raise unsupported(f"a layer:{t} piece whose exports are {ex}")
        events = tuple(own(f"layer:{t}", "", ex[0]["id"]))
        layers[(t, False)] = layers[(t, True)] = events
    norm_ex = exports("norm")
    if len(norm_ex) != 1 or norm_ex[0]["dies"] != {"piece": "end", "at": 0}:
        raise unsupported(f"a final norm whose exports are {norm_ex}")
    final = own("norm", "n.", None)
    final += [("-@prev", 0), ("-@embeds", 0)] + [("-p." + ex["id"], 0) for ex in exports("prologue")]
    return BodyEvents(prologue=prologue, layers=layers, final=tuple(final), label=labels.get, embeds_to_end=True)


@functools.lru_cache(maxsize=256)
def norm_program(d: DecoderDims, rows: int, dtype_bytes: int, out_bytes: int):
    if dtype_bytes not in PROGRAM_DTYPE_BYTES.values() or rows < 2:
        return None
    p = d.program
    try:
        values = programs.bind(p, d.dims, rows)
    except programs.ProgramError:
        return None
    (out,) = [ex["id"] for ex in p["pieces"]["norm"]["exports"]]
    steps = []
    for kind, ident, n, _ in programs.piece_events(p, values, "norm"):
        key = "out:out" if ident == out else ident
        steps.append(("alloc", key, out_bytes if ident == out else n) if kind == "a" else ("free", key, 0))
    return tuple(steps)


def body_flops(d: DecoderDims, seq: int) -> int:
    """The body's matmul FLOPs (2 per multiply-add, PaLM appendix B): every layer weight once per token (for MoE
    the routed experts only: top_k of the experts' weights) and causal attention's two [seq, seq] products. An
    estimate for check's busy time, not a measurement."""
    v = d.dims
    per_layer = component_params(d)["layers"] // max(1, d.num_hidden_layers)
    if "experts" in v:      # 3 weights of [hidden, moe_intermediate] per expert (gate, up, down)
        per_layer -= (v["experts"] - v["top_k"]) * 3 * v["hidden"] * v["moe_intermediate"]
    attention = 2 * seq * seq * v["heads"] * v["head_dim"]     # QK^T and PV over the causal half: 2 * 2 * s^2/2
    return d.num_hidden_layers * (2 * seq * per_layer + attention)


def component_params(d: DecoderDims) -> dict[str, int]:
    """Parameters per component, from the program's derived parameter counts (tied embeddings: lm_head is the
    embedding's weight, counted once)."""
    p = d.program
    if "params" not in p:
        raise programs.ProgramError(f"the stored {d.arch} program has no parameter counts: rederive it "
                                    f"(python tools/derive_programs.py --arch {d.arch})")
    out = dict(programs.params(p, d.dims, list(d.layer_types)))
    if d.tie_word_embeddings:
        out["lm_head"] = 0
    return out


def forward_assumptions(d: DecoderDims, declared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How the prediction assumes transformers runs this model's forward (check --json `models`)."""
    declared = declared or {}
    p = d.program
    pack = {"documents": "documents one by one", "mask": "packed with a [seq, seq] mask"}[d.packing]
    return {
        "attn_implementation": {"value": d.attn_implementation, "means": f"attention {d.attn_implementation}",
                                "source": "declared" if declared.get("attn_implementation") else
                                "default: transformers"},
        "packing": {"value": d.packing, "means": pack,
                    "source": "declared" if declared.get("packing") else "default: as dflash-graph run does"},
        "program": {"value": Path(p["path"]).name,
                    "means": f"memory program derived from transformers {p['key']['transformers']} "
                             f"{p['model_class']}" + (f" (experts {p['experts_implementation']})"
                                                      if p.get("experts_implementation") else ""),
                    "source": "dflash-graph trace-model (a user program, derived for this config's "
                              f"{', '.join(f'{k} = {v}' for k, v in d.fixed)})" if d.fixed else
                              "tools/derive_programs.py"},
        "not_measured": [f"CPU trace of sdpa ({p['key']['kernels']}; CUDA's kernels assumed to allocate alike)"],
    }
