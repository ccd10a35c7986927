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

`auto_map = {"AutoModel": "dflash.DFlashDraftModel"}`: what z-lab's README loader (`AutoModel.from_pretrained(DIR,
trust_remote_code=True)`) reads to build `DFlashDraftModel` rather than a plain Qwen3Model, as z-lab's published
configs carry it (e.g. z-lab/Qwen3-8B-DFlash-b16). transformers then imports `dflash.py` from DIR: that modeling
file is z-lab's (MIT licence), not ours, so export does not ship it; `--modeling-file PATH` copies a local copy in
(its licence notice travels with it). SGLang and vLLM ignore `auto_map`: they build their own DFlash model from
`architectures` and `dflash_config`.

`dflash_config.mask_token`: the target tokenizer's string for `mask_token_id`. SGLang
(`python/sglang/srt/speculative/dflash_worker.py`, `_resolve_mask_token_id`) reads `mask_token` (default
`"<|MASK|>"`, `dflash_utils.py` DEFAULT_DFLASH_MASK_TOKEN) and refuses the draft when the target tokenizer maps
that string to another id than `mask_token_id`; written, the two always agree.

Files are written readable by others (0666 less the umask, as `open()` creates files: 0644 under the usual umask
022), so a serving container running as another user can read them; an existing non-empty directory is refused
unless `overwrite` (`dflash-graph export --overwrite`).

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


AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}


def config(dims, num_target_layers: int, dtype: str, max_position_embeddings: int, mask_token: str | None = None
           ) -> dict:
    d = dims
    dflash = {"target_layer_ids": list(d.target_layer_ids), "block_size": d.block_size,
              "mask_token_id": d.mask_token_id, "num_target_layers": num_target_layers}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": dict(AUTO_MAP),
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
        "dflash_config": dflash,
    }


def mask_token_string(tokenizer_path: Path | None, mask_token_id: int) -> str | None:
    """The target tokenizer's token for `mask_token_id`; None without a tokenizer (the graph names none)."""
    if tokenizer_path is None:
        return None
    from .corpus import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    s = tok.convert_ids_to_tokens(int(mask_token_id))
    return s if isinstance(s, str) and s else None


def _readable(path: Path) -> None:
    """0666 less the umask, as open() creates a file (safetensors' writer leaves 0600)."""
    import os

    um = os.umask(0)
    os.umask(um)
    os.chmod(path, 0o666 & ~um)


def refuse_existing(out: Path, flag: str = "--out") -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GraphError(Problem("exists and is not empty: export does not overwrite a directory silently",
                                 Location(flag=f"{flag} {out}"),
                                 hint="name a new directory, or pass --overwrite to replace its config.json and "
                                      "model.safetensors"))


def export(drafter, dims, norm_weight: torch.Tensor, target_config, out: Path, dtype: str = "bfloat16",
           drafter_name: str = "drafter", loc: Location | None = None, *, norm_plus_one: bool,
           overwrite: bool = False, mask_token: str | None = None, modeling_file: Path | None = None) -> Path:
    """Write `out/config.json` and `out/model.safetensors` for a trained `drafter` (DFlashDrafter) whose final
    norm is the target's (`norm_weight`: a (1 + w) norm where `norm_plus_one`, a plain w norm otherwise);
    `target_config` gives num_hidden_layers and max_position_embeddings; `loc` is where the graph declares the
    drafter's config; `mask_token` the target tokenizer's string for the mask id (mask_token_string);
    `modeling_file` a local copy of z-lab's dflash.py, copied in for `auto_map`."""
    d = dims
    if not overwrite:
        refuse_existing(out)
    if modeling_file is not None and not modeling_file.is_file():
        raise GraphError(Problem("no such file", Location(flag=f"--modeling-file {modeling_file}"),
                                 hint="a local copy of z-lab's dflash.py (the modeling file of their published "
                                      "drafters, e.g. z-lab/Qwen3-8B-DFlash-b16)"))
    if d.target_hidden_size != d.hidden_size:
        raise GraphError(Problem("the DFlash format needs the drafter's hidden_size equal to the target's",
                                 loc or Location(path=f"models.{drafter_name}.config"),
                                 expected=f"hidden_size = {d.target_hidden_size}", actual=str(d.hidden_size)))
    from .checkpoint import save_tensors   # safetensors' I/O failures as the OSError they are

    out.mkdir(parents=True, exist_ok=True)
    sd = state_dict(drafter, norm_weight, DTYPES[dtype], norm_plus_one)
    save_tensors(sd, out / "model.safetensors", {"format": "pt"})
    _readable(out / "model.safetensors")
    get = target_config.get if isinstance(target_config, dict) else lambda k, dflt=None: getattr(target_config, k, dflt)
    cfg = config(d, int(get("num_hidden_layers")), dtype, int(get("max_position_embeddings", 32768) or 32768),
                 mask_token)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _readable(out / "config.json")
    if modeling_file is not None:
        import shutil

        shutil.copyfile(modeling_file, out / "dflash.py")
        _readable(out / "dflash.py")
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
    spec = trainer.plan.typed.ctx.spec
    dims = trainer.plan.typed.ctx.models[name].dims
    # the run's own directory (run refused an existing one unless --overwrite or --resume): its export is replaced
    return export(trainer.whole_weights.get(name, drafter), dims, norm,
                  dict(trainer.plan.typed.ctx.models[target].config), out, dtype, name,
                  spec.loc("models", name, "config"),
                  norm_plus_one=ARCHS[trainer.plan.typed.ctx.models[target].spec.arch].norm_plus_one, overwrite=True,
                  mask_token=mask_token_string(tokenizer_path(spec), dims.mask_token_id))


def tokenizer_path(spec) -> Path | None:
    """The target's tokenizer, as the graph's [data] names it (None when it names none)."""
    t = spec.data.get("tokenizer")
    return Path(spec.data.get("_base", ".")) / t if t else None
