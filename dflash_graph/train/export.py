"""Export a trained drafter as the DFlash draft format that z-lab's reference code and SGLang load.

The format (read from z-lab/dflash `dflash/model.py`: `DFlashDraftModel`, `Qwen3DFlashAttention`,
`Qwen3DFlashDecoderLayer`, `_draft_value`; and sgl-project/sglang `python/sglang/srt/models/dflash.py`:
`DFlashDraftModel.load_weights`, with `python/sglang/srt/speculative/dflash_utils.py`:
`parse_dflash_draft_config`): a Hugging Face directory with

* `config.json`: a Qwen3 config (`hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
  `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta`, `vocab_size`, ...), `architectures =
  ["DFlashDraftModel"]`, and `dflash_config = {target_layer_ids, block_size, mask_token_id, num_target_layers}`
  (both readers take these from `dflash_config` first; `block_size` also at the top level, as older checkpoints
  have it);
* `model.safetensors`: no embedding and no lm_head (both readers use the target's), and
  `fc.weight`, `hidden_norm.weight`, `norm.weight`, and per layer `layers.{i}.input_layernorm.weight`,
  `layers.{i}.post_attention_layernorm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
  `layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`; bf16 by default.

`norm.weight`: both readers give the drafter its own plain RMSNorm (w * x/rms(x)) before the target's lm_head;
the graphs train through the target's own final norm, so the export writes the weight that makes the plain norm
equal it: 1 + w for a family whose norm is (1 + w) * x/rms(x) (Qwen3.5: `Arch.norm_plus_one` in
models/registry.py), w itself for a plain one (Qwen3, Llama, Qwen3-MoE) (docs/drafter.md, "The final norm").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import GraphError, Location, Problem
from ..models.published import export_name   # the names, read back by models/published.py (one adapter)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def state_dict(drafter, target_norm_weight: torch.Tensor, dtype: torch.dtype, norm_plus_one: bool
               ) -> dict[str, torch.Tensor]:
    sd = drafter if isinstance(drafter, dict) else drafter.state_dict()   # or a sharded drafter's, gathered
    out = {export_name(k): v.detach().to("cpu", torch.float32) for k, v in sd.items()}
    if "norm.weight" not in out:     # the drafter trains its own final norm: its weight is written as is
        w = target_norm_weight.detach().to("cpu", torch.float32)
        out["norm.weight"] = 1.0 + w if norm_plus_one else w.clone()
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def config(dims, num_target_layers: int, dtype: str, max_position_embeddings: int) -> dict:
    d = dims
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_hidden_layers,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": d.rms_norm_eps,
        "rope_theta": d.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": d.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": d.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(d.target_layer_ids), "block_size": d.block_size,
                          "mask_token_id": d.mask_token_id, "num_target_layers": num_target_layers},
    }


def export(drafter, dims, norm_weight: torch.Tensor, target_config, out: Path, dtype: str = "bfloat16",
           drafter_name: str = "drafter", loc: Location | None = None, *, norm_plus_one: bool) -> Path:
    """Write `out/config.json` and `out/model.safetensors` for a trained `drafter` (DFlashDrafter) whose final
    norm is the target's (`norm_weight`: a (1 + w) norm where `norm_plus_one`, a plain w norm otherwise);
    `target_config` gives num_hidden_layers and max_position_embeddings; `loc` is where the graph declares the
    drafter's config."""
    d = dims
    if d.target_hidden_size != d.hidden_size:
        raise GraphError(Problem("the DFlash format needs the drafter's hidden_size equal to the target's",
                                 loc or Location(path=f"models.{drafter_name}.config"),
                                 expected=f"hidden_size = {d.target_hidden_size}", actual=str(d.hidden_size)))
    from .checkpoint import save_tensors   # safetensors' I/O failures as the OSError they are

    out.mkdir(parents=True, exist_ok=True)
    sd = state_dict(drafter, norm_weight, DTYPES[dtype], norm_plus_one)
    save_tensors(sd, out / "model.safetensors", {"format": "pt"})
    get = target_config.get if isinstance(target_config, dict) else lambda k, dflt=None: getattr(target_config, k, dflt)
    cfg = config(d, int(get("num_hidden_layers")), dtype, int(get("max_position_embeddings", 32768) or 32768))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def export_trainer(trainer, out: Path, dtype: str = "bfloat16") -> Path:
    """Export at the end of `dflash-graph run`, from the trainer's own modules."""
    from ..models.registry import ARCHS
    from .trained import drafter_names

    name, target = drafter_names(trainer.plan)
    store = trainer.store
    drafter = store.drafters[name]
    tdev = str(next(drafter.parameters()).device)
    norm = store.component(name, "norm", tdev).weight
    # a sharded drafter (parallel = "fsdp") holds 1/M of its weights: its whole weights, gathered at the last save
    return export(trainer.whole_weights.get(name, drafter), trainer.plan.typed.ctx.models[name].dims, norm,
                  dict(trainer.plan.typed.ctx.models[target].config), out, dtype, name,
                  trainer.plan.typed.ctx.spec.loc("models", name, "config"),
                  norm_plus_one=ARCHS[trainer.plan.typed.ctx.models[target].spec.arch].norm_plus_one)
