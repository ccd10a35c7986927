"""Torch-side helpers for a Qwen3.5 target (transformers ``Qwen3_5ForCausalLM``).

Everything here works from local files only: no model hub, no network.

* :func:`build_target`   - a ``Qwen3_5ForCausalLM`` from a local config (dict, config.json,
                           or a directory) and local weights (a directory or a
                           ``.safetensors`` file), or randomly initialised.
* :func:`body_forward`   - the transformer body only (never ``lm_head``) over a packed
                           sequence, document by document, with layer outputs captured
                           by forward hooks.
* :func:`final_norm`, :func:`lm_head`, :func:`embedding` - the target's own modules. Use
  the target's own final norm: Qwen3.5's RMSNorm scales by ``(1 + w)``, not ``w``
  (speculators issue 1098), so a rebuilt plain RMSNorm gives wrong verifier logits.
* :func:`load_tokenizer` - a ``PreTrainedTokenizerFast`` from a local tokenizer.json.

Layer ids follow DFlash: layer id ``i`` is the OUTPUT of decoder layer ``i``, which is
transformers' ``hidden_states[i + 1]`` for ``i < L - 1``. Note that transformers
overwrites ``hidden_states[L]`` (the last entry) with the final-NORMED state, while
layer id ``L - 1`` here is the raw output of the last decoder layer (pre-norm).

Packed sequences: documents start where ``position_ids == 0``. transformers isolates
packed documents in its full-attention layers (a block-diagonal mask derived from
position ids), but the Gated DeltaNet layers (torch fallback, and the causal conv1d
before it) ignore document boundaries and carry state across the whole row. So by
default (``packing="documents"``) :func:`body_forward` runs each document separately and
concatenates the results. A graph that declares ``packing = "mask"`` or ``"cu_seqlens"``
gets what a user's script gets from ``model.model(input_ids, position_ids=...)`` over the
whole packed row: transformers' own forward, with the dense mask (sdpa, eager) or the
cu_seqlens (flash_attention_2) it derives from the position ids, so that a measurement
of the run is a measurement of the forward ``check`` predicts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "build_target",
    "body_forward",
    "document_spans",
    "embedding",
    "final_norm",
    "lm_head",
    "load_config",
    "load_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def _offline() -> None:
    # Belt and braces: nothing in this module ever asks the hub, but a library call
    # deep inside transformers might try to; these make it fail fast instead of hang.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------- config / model
def load_config(config: Mapping[str, Any] | str | Path):
    """A ``Qwen3_5TextConfig`` from a dict, a config.json path, or a directory holding one.

    A full multimodal Qwen3.5 config (``model_type`` "qwen3_5" with a ``text_config``)
    is reduced to its text config, which is what ``Qwen3_5ForCausalLM`` needs.
    """
    from transformers import Qwen3_5TextConfig

    if isinstance(config, Qwen3_5TextConfig):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"config must be a dict, a path to config.json or a directory, got {type(config).__name__}")
    if data.get("model_type") == "qwen3_5" or "text_config" in data:
        text = dict(data.get("text_config") or {})
        for key in ("tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id"):
            if key in data and key not in text:
                text[key] = data[key]
        data = text
    mt = data.pop("model_type", "qwen3_5_text")
    if mt != "qwen3_5_text":
        raise ValueError(f"expected a Qwen3.5 text config (model_type 'qwen3_5_text'), got model_type {mt!r}")
    return Qwen3_5TextConfig.from_dict(data)


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if path.is_file():
        return load_file(str(path))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for name in files:
            state.update(load_file(str(path / name)))
        return state
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return load_file(str(found[0]))
    raise FileNotFoundError(f"no model.safetensors(.index.json) under {path}")


def _remap_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map a Qwen3_5ForConditionalGeneration checkpoint's text keys onto Qwen3_5ForCausalLM."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith(("mtp.", "model.visual.", "visual.")):
            continue  # multi-token-prediction head and vision tower: not part of the text model
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        elif key.startswith("language_model."):
            key = "model." + key[len("language_model.") :]
        out[key] = value
    return out


def build_target(
    config: Mapping[str, Any] | str | Path,
    weights: str | Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_implementation: str = "sdpa",
):
    """Build a ``Qwen3_5ForCausalLM`` in eval mode on ``device`` with parameters in ``dtype``.

    ``config``: a dict, a path to config.json, or a directory with one.
    ``weights``: a directory (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``) or one ``.safetensors`` file, loaded with
    safetensors and checked strictly (missing or unexpected keys raise); ``None``
    keeps transformers' random init, which the caller seeds (``torch.manual_seed``).
    ``attn_implementation``: transformers' attention interface ("sdpa", "eager",
    "flash_attention_2"; the last needs the flash-attn package and a CUDA device).
    Never touches the network.
    """
    _offline()
    from transformers import Qwen3_5ForCausalLM

    cfg = load_config(config)
    device = torch.device(device)
    with torch.device(device):
        # _from_config builds the parameters directly in `dtype` (no fp32 detour)
        model = Qwen3_5ForCausalLM._from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    if weights is not None:
        state = _remap_keys(_read_safetensors(Path(weights)))
        if cfg.tie_word_embeddings and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"weights {weights} do not match the config: missing {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}, unexpected {result.unexpected_keys[:8]}"
                f"{'...' if len(result.unexpected_keys) > 8 else ''}"
            )
    model.eval()
    return model


# --------------------------------------------------------------------------- module accessors
def final_norm(model) -> nn.Module:
    """The target's own final RMSNorm (``model.model.norm``; scales by ``1 + w``)."""
    return model.model.norm


def lm_head(model) -> nn.Module:
    """The target's ``lm_head`` (``Linear(H, V, bias=False)``)."""
    return model.lm_head


def embedding(model) -> nn.Embedding:
    """The target's token embedding (``model.model.embed_tokens``)."""
    return model.model.embed_tokens


# --------------------------------------------------------------------------- body forward
def document_spans(position_ids: Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the documents of a packed 1-D sequence: a document
    starts at index 0 and wherever ``position_ids == 0``."""
    if position_ids.ndim != 1:
        raise ValueError(f"position_ids must be 1-D [T], got shape {tuple(position_ids.shape)}")
    n = int(position_ids.shape[0])
    if n == 0:
        return []
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], n]
    return list(zip(starts, ends, strict=True))


PACKINGS = ("documents", "mask", "cu_seqlens")


def body_forward(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    capture: Sequence[int],
    packing: str = "documents",
) -> tuple[Tensor, dict[int, Tensor]]:
    """Run the body ``model.model`` (not ``lm_head``) over a packed sequence.

    ``input_ids`` and ``position_ids`` are 1-D ``[T]``; documents start where
    ``position_ids == 0``. ``packing="documents"`` runs them one at a time, so no attention
    (full or linear) crosses a document boundary; ``"mask"`` and ``"cu_seqlens"`` run the
    packed row in one call with its position ids, as transformers does for any caller
    (full attention stays within a document; the reference Gated DeltaNet kernels do not).
    Runs under the caller's grad mode.

    Returns ``(last, captured)``: ``last`` is the output of the last decoder layer
    BEFORE the final norm, ``[T, H]``; ``captured[i]`` is the output of decoder layer
    ``i`` (``hidden_states[i + 1]`` in transformers), ``[T, H]``, for each ``i`` in
    ``capture``. Hooks are removed afterwards, also on error.
    """
    if input_ids.ndim != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and position_ids must both be 1-D [T] of the same length, got "
            f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
        )
    body = model.model
    layers = body.layers
    n_layers = len(layers)
    ids = [int(i) for i in capture]
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"capture layer ids {bad} out of range [0, {n_layers - 1}]")
    wanted = sorted(set(ids) | {n_layers - 1})

    pieces: dict[int, list[Tensor]] = {i: [] for i in wanted}

    def make_hook(layer_id: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            pieces[layer_id].append(out[0])  # drop the batch axis of size 1

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in wanted]
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    spans = document_spans(position_ids) if packing == "documents" else [(0, int(input_ids.shape[0]))]
    try:
        for start, end in spans:
            body(
                input_ids=input_ids[start:end].unsqueeze(0),
                position_ids=position_ids[start:end].unsqueeze(0),
                use_cache=False,
            )
    finally:
        for h in handles:
            h.remove()

    def join(parts: list[Tensor]) -> Tensor:
        if not parts:
            return torch.empty(0, body.config.hidden_size, device=input_ids.device, dtype=body.embed_tokens.weight.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    captured = {i: join(pieces[i]) for i in ids}
    last = captured[n_layers - 1] if (n_layers - 1) in captured else join(pieces[n_layers - 1])
    return last, captured


# --------------------------------------------------------------------------- tokenizer
def load_tokenizer(path: str | Path):
    """A ``PreTrainedTokenizerFast`` from a local ``tokenizer.json`` (or a directory
    holding one), with ``<|endoftext|>`` as eos and pad and ``<|mask|>`` as mask token
    when the vocabulary has them. ``.backend_tokenizer`` is the raw
    ``tokenizers.Tokenizer``. Never touches the network."""
    _offline()
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(file))
    vocab = raw.get_vocab(with_added_tokens=True)
    special: dict[str, str] = {}
    if EOS_TOKEN in vocab:
        special.update(eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    if MASK_TOKEN in vocab:
        special["mask_token"] = MASK_TOKEN
    return PreTrainedTokenizerFast(tokenizer_object=raw, **special)
