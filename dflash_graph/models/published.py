"""Published DFlash draft checkpoints, read without torch: what `[models.<drafter>] weights = PATH` names.

Two formats hold the same drafter under the same tensor names:

* z-lab's (what `dflash-graph export` writes: train/export.py; z-lab/dflash `dflash/model.py`, SGLang
  `python/sglang/srt/speculative/dflash_utils.py:parse_dflash_draft_config`): `config.json` is a Qwen3 config
  with `architectures = ["DFlashDraftModel"]` and `dflash_config = {target_layer_ids, block_size, mask_token_id,
  num_target_layers}` (`block_size` at the top level in older checkpoints); `model.safetensors` holds `fc`,
  `hidden_norm`, `norm` and `layers.{i}.{self_attn.*, mlp.*, *_layernorm}`, no embedding and no lm_head.
* speculators' (vllm-project/speculators 0.9.0: `speculators/models/dflash/config.py:DFlashSpeculatorConfig`,
  `speculators/models/dflash/core.py:DFlashDraftModel`, `speculators/convert/dflash/converter.py:DFlashConverter`):
  `config.json` has `speculators_model_type = "dflash"`, the layers' Qwen3 config under
  `transformer_layer_config`, and `block_size`, `mask_token_id`, `draft_vocab_size`, `target_hidden_size` and
  `aux_hidden_state_layer_ids` at the top level. The safetensors use z-lab's names (the converter copies them
  as they are) and may add `embed_tokens`, `lm_head`, `t2d` and `d2t` (a reduced draft vocabulary).

NOTE [Layer ids of the two formats]: z-lab's `target_layer_ids` (and this project's) name decoder layers whose
OUTPUT is captured, HF `hidden_states[i + 1]`; speculators' `aux_hidden_state_layer_ids` index `hidden_states`
itself (0 is the embedding's output), as `DFlashConverter._build_config` says ("z-lab reads hidden_states[layer_id
+ 1] ... while speculators uses the layer id directly") and converts with `i + 1`. So a speculators id j is this
project's j - 1; an id 0 (the embeddings) has no equivalent here.

`read(path)` returns a `DraftCheckpoint` in this project's terms (config keys of `models.dflash.DFlashDims`,
tensor names of `models.nn.dflash.DFlashDrafter`'s state dict) or raises `CheckpointError`; `analysis/
drafter_weights.py` checks it against the graph and `exec/models.py` loads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .dflash import DFlashDims

#: this project's DFlashLayer attribute -> the formats' decoder-layer name
LAYER_NAMES = {
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}
_FROM_FORMAT = {v: k for k, v in LAYER_NAMES.items()}

#: tensors a checkpoint may carry that belong to the target (this project shares the target's embedding and
#: lm_head) or to speculators' bookkeeping: read past, never loaded
TARGET_OWNED = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                          "verifier_norm.weight", "t2d", "d2t"})

#: the drafter's own final norm: both formats carry one (the drafter's norm before the target's lm_head)
NORM = "norm.weight"

#: the values transformers' Qwen3Config takes when a key is absent (transformers 5.24; tests/test_finetune.py
#: compares them with Qwen3Config()): a speculators config written by `to_diff_dict` may leave them out
QWEN3_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}

#: the config keys a checkpoint must give and the graph's drafter must equal, in the order they are reported
COMPARED = ("block_size", "target_layer_ids", "mask_token_id", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "target_hidden_size", "rms_norm_eps", "rope_theta")

MAX_HEADER = 100 * 2**20    # a safetensors header over 100 MiB is not a drafter's (one is a few KiB)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a DFlash draft: `message`, `hint`."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


@attrs.frozen
class DraftCheckpoint:
    path: Path                                  # the directory holding config.json
    format: str                                 # "z-lab" or "speculators"
    files: tuple[Path, ...]                     # the safetensors files
    config: Mapping[str, Any]                   # the COMPARED keys, this project's meaning (layer ids included)
    num_target_layers: int | None               # the target the drafter was trained for (z-lab's dflash_config)
    tensors: Mapping[str, tuple[tuple[int, ...], str]]   # this project's name (and NORM) -> (shape, dtype)
    names: Mapping[str, str]                    # this project's name -> the checkpoint's
    ignored: tuple[str, ...]                    # TARGET_OWNED tensors present


def import_name(name: str) -> str | None:
    """This project's state-dict name for a format's tensor name (None: not the drafter's)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdigit():
        mine = _FROM_FORMAT.get(".".join(parts[2:-1]))
        return None if mine is None else ".".join(["layers", parts[1], mine, parts[-1]])
    return name if name in ("fc.weight", "hidden_norm.weight", NORM) else None


def export_name(name: str) -> str:
    """The format's tensor name for this project's state-dict name."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(["layers", parts[1], LAYER_NAMES[parts[2]], *parts[3:]])
    return name


def expected_shapes(d: DFlashDims) -> dict[str, tuple[int, ...]]:
    """The drafter's state dict, name -> shape (DFlashDrafter's; tests/test_finetune.py compares them), with the
    formats' own final norm (NORM)."""
    h, hd, i = d.hidden_size, d.head_dim, d.intermediate_size
    q, kv = d.num_attention_heads * hd, d.num_key_value_heads * hd
    out = {"fc.weight": (h, d.fc_in_features), "hidden_norm.weight": (h,)}
    layer = {"input_layernorm": (h,), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
             "q_norm": (hd,), "k_norm": (hd,), "post_attention_layernorm": (h,), "gate_proj": (i, h),
             "up_proj": (i, h), "down_proj": (h, i)}
    for n in range(d.num_hidden_layers):
        out.update({f"layers.{n}.{k}.weight": s for k, s in layer.items()})
    out[NORM] = (h,)
    return out


def safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from a safetensors file's header (8 bytes of length, then JSON), no tensor read."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is not a safetensors file: it has {len(head)} bytes",
                                      "the weights are model.safetensors as `dflash-graph export` writes it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise CheckpointError(f"{file} is not a safetensors file: its header would be {n:,} bytes",
                                      "the weights are model.safetensors as `dflash-graph export` writes it")
            meta = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}", "check the path and its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON ({e})",
                              "the weights are model.safetensors as `dflash-graph export` writes it") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} is not a safetensors file: its header is not a JSON object",
                              "the weights are model.safetensors as `dflash-graph export` writes it")
    out = {}
    for k, v in meta.items():
        if k == "__metadata__":
            continue
        if not (isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)):
            raise CheckpointError(f"{file}: the header's entry {k!r} has no shape and dtype",
                                  "the file is damaged; export or download it again")
        out[k] = (tuple(int(x) for x in v["shape"]), v["dtype"])
    return out


def _files(path: Path) -> tuple[Path, Path, tuple[Path, ...]]:
    """(directory, config.json, safetensors files) for a checkpoint directory or its .safetensors file."""
    if path.is_file():
        d, files = path.parent, (path,)
    else:
        d = path
        index = d / "model.safetensors.index.json"
        if (d / "model.safetensors").is_file():
            files = (d / "model.safetensors",)
        elif index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
                files = tuple(d / f for f in dict.fromkeys(wmap.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"cannot read the shard index {index}: {e}",
                                      "an index is {\"weight_map\": {tensor name: shard file}}") from None
        else:
            raise CheckpointError(f"{d} has no model.safetensors (nor a model.safetensors.index.json)",
                                  "weights names a DFlash draft directory (config.json + model.safetensors), as "
                                  "`dflash-graph export` writes, or its model.safetensors")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{d} has no config.json beside the weights",
                              "a DFlash draft checkpoint is config.json + model.safetensors in one directory")
    return d, cfg, files


def _need(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"the checkpoint's config.json does not give {where}{key}",
                              "a DFlash draft config carries the drafter's Qwen3 keys and its dflash keys "
                              "(docs/drafter.md, \"Fine-tuning a published drafter\")")
    return cfg[key]


def _rope_theta(cfg: Mapping[str, Any]) -> Any:
    rope = cfg.get("rope_parameters")
    if isinstance(rope, Mapping) and rope.get("rope_theta") is not None:
        return rope["rope_theta"]
    return cfg.get("rope_theta", QWEN3_DEFAULTS["rope_theta"])


def _layers_config(layers: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {k: _need(layers, k, where) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "vocab_size")}
    out["head_dim"] = layers.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    out["rms_norm_eps"] = layers.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])
    out["rope_theta"] = _rope_theta(layers)
    rope = layers.get("rope_parameters") or layers.get("rope_scaling")
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"the checkpoint's drafter uses {rope.get('rope_type', rope.get('type'))!r} RoPE",
                              "dflash-graph's drafter implements the default RoPE only")
    kinds = layers.get("layer_types") or ()
    if any(k != "full_attention" for k in kinds):
        raise CheckpointError(f"the checkpoint's drafter has layer types {sorted(set(kinds))}",
                              "dflash-graph's drafter has full-attention layers only (no sliding window)")
    return out


def read_config(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any], int | None]:
    """(format, the COMPARED keys in this project's meaning, num_target_layers or None) from a config.json."""
    if cfg.get("speculators_model_type") is not None:
        kind = cfg["speculators_model_type"]
        if kind != "dflash":
            raise CheckpointError(f"the checkpoint is a speculators {kind!r} model, not a DFlash drafter",
                                  "weights names a DFlash draft checkpoint (speculators_model_type \"dflash\")")
        layers = cfg.get("transformer_layer_config")
        if not isinstance(layers, Mapping):
            raise CheckpointError("the checkpoint's config.json has no transformer_layer_config",
                                  "a speculators DFlash config carries the drafter's layers' Qwen3 config there")
        out = _layers_config(layers, "transformer_layer_config.")
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None and draft_vocab != out["vocab_size"]:
            raise CheckpointError(f"the checkpoint drafts over a reduced vocabulary of {draft_vocab:,} tokens "
                                  f"(the target's: {out['vocab_size']:,}) with its own lm_head and d2t map",
                                  "dflash-graph's drafter drafts over the target's vocabulary through the "
                                  "target's lm_head; use a full-vocabulary checkpoint")
        if cfg.get("sample_from_anchor"):
            raise CheckpointError("the checkpoint was trained to sample from the anchor slot too "
                                  "(sample_from_anchor = true)",
                                  "dflash-graph's drafter drafts from slot 1 on, as DFlash does")
        aux = _need(cfg, "aux_hidden_state_layer_ids", "")
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
            raise CheckpointError(f"aux_hidden_state_layer_ids = {aux!r} is not a list of layer ids",
                                  "speculators writes a list of hidden_states indices")
        if 0 in aux:
            raise CheckpointError(f"aux_hidden_state_layer_ids = {aux} reads hidden_states[0], the target's "
                                  "embeddings", "dflash-graph's drafter reads decoder layers' outputs only")
        out["target_layer_ids"] = [i - 1 for i in aux]      # NOTE [Layer ids of the two formats]
        out["block_size"] = _need(cfg, "block_size", "")
        out["mask_token_id"] = cfg.get("mask_token_id")
        out["target_hidden_size"] = cfg.get("target_hidden_size") or out["hidden_size"]
        return "speculators", out, None
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, Mapping) and "DFlashDraftModel" not in (cfg.get("architectures") or ()):
        raise CheckpointError("the checkpoint's config.json is not a DFlash draft config (no dflash_config, "
                              f"architectures {cfg.get('architectures')!r})",
                              "weights names a DFlash draft checkpoint: `dflash-graph export`'s, z-lab's or "
                              "speculators'")
    dflash = dflash if isinstance(dflash, Mapping) else {}
    out = _layers_config(cfg, "")
    both = {**cfg, **dflash}                       # the readers take dflash_config's first
    out["block_size"] = _need(both, "block_size", "dflash_config.")
    out["target_layer_ids"] = _need(both, "target_layer_ids", "dflash_config.")
    out["mask_token_id"] = both.get("mask_token_id")
    out["target_hidden_size"] = cfg.get("target_hidden_size") or out["hidden_size"]
    return "z-lab", out, both.get("num_target_layers")


def read(path: Path) -> DraftCheckpoint:
    """The checkpoint at `path` (a directory, or a .safetensors file with config.json beside it)."""
    d, cfg_file, files = _files(path)
    try:
        cfg = json.loads(cfg_file.read_text())
    except OSError as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e.strerror or e}", "check the path") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}", "export or download it again") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not a config",
                              "export or download it again")
    fmt, config, num_target = read_config(cfg)
    tensors, names, ignored, foreign = {}, {}, [], []
    for f in files:
        for name, meta in safetensors_header(f).items():
            mine = import_name(name)
            if mine is not None:
                tensors[mine], names[mine] = meta, name
            elif name in TARGET_OWNED:
                ignored.append(name)
            else:
                foreign.append(name)
    if foreign:
        raise CheckpointError(f"the checkpoint holds tensors a DFlash drafter does not have: "
                              f"{', '.join(sorted(foreign)[:6])}{' ...' if len(foreign) > 6 else ''}",
                              "a DFlash draft checkpoint holds fc, hidden_norm, norm and layers.* (docs/drafter.md, "
                              "\"Fine-tuning a published drafter\")")
    return DraftCheckpoint(d, fmt, files, config, num_target, tensors, names, tuple(ignored))
