"""Torch-side helpers for a target: any causal LM the registry names (models/registry.py `ARCHS[arch]`:
`hf_config`, `hf_causal_lm`), built through transformers' own class.

Everything here works from local files only: no model hub, no network.

* :func:`build_target`   - the arch's causal LM (``Qwen3ForCausalLM``, ``LlamaForCausalLM``,
                           ``Qwen3MoeForCausalLM``, ``Qwen3_5ForCausalLM``, ...) from a local config
                           (dict, config.json, or a directory) and local weights (a directory or a
                           ``.safetensors`` file, sharded or not), or randomly initialised.
* :func:`body_forward`   - the transformer body only (never ``lm_head``) over a packed
                           sequence, document by document, with layer outputs captured
                           by forward hooks on ``model.model.layers``.
* :func:`final_norm`, :func:`lm_head`, :func:`embedding` - the target's own modules. Use
  the target's own final norm: Qwen3.5's RMSNorm scales by ``(1 + w)``, Qwen3's and Llama's
  by ``w`` (speculators issue 1098: a rebuilt plain RMSNorm gives wrong Qwen3.5 verifier logits).
* :func:`load_tokenizer` - a ``PreTrainedTokenizerFast`` from a local tokenizer.json.

Layer ids follow DFlash: layer id ``i`` is the OUTPUT of decoder layer ``i``, which is
transformers' ``hidden_states[i + 1]`` for ``i < L - 1``. Note that transformers
overwrites ``hidden_states[L]`` (the last entry) with the final-NORMED state, while
layer id ``L - 1`` here is the raw output of the last decoder layer (pre-norm).

Packed sequences: documents start where ``position_ids == 0``. transformers isolates
packed documents in its full-attention layers (a block-diagonal mask derived from
position ids), but Qwen3.5's Gated DeltaNet layers (torch fallback, and the causal conv1d
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..registry import ARCHS, target_arch_of

__all__ = [
    "build_target",
    "body_forward",
    "document_spans",
    "embedding",
    "final_norm",
    "lm_head",
    "load_config",
    "load_tokenizer",
    "mask_token_rule",
]

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>")   # Qwen's, Llama 3's
MASK_TOKEN = "<|mask|>"


def _offline() -> None:
    # Belt and braces: nothing in this module ever asks the hub, but a library call
    # deep inside transformers might try to; these make it fail fast instead of hang.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------- config / model
def _qwen3_5_text(data: dict[str, Any]) -> dict[str, Any]:
    """A full multimodal Qwen3.5 config (``model_type`` "qwen3_5" with a ``text_config``) reduced to its text
    config, which is what ``Qwen3_5ForCausalLM`` needs."""
    if data.get("model_type") == "qwen3_5" or "text_config" in data:
        text = dict(data.get("text_config") or {})
        for key in ("tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id"):
            if key in data and key not in text:
                text[key] = data[key]
        text.setdefault("model_type", "qwen3_5_text")
        return text
    return data


def _qwen3_5_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
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


# NOTE [Family adapters]: what one family's files need before transformers' own class reads them. Qwen3.5 ships as
# a multimodal checkpoint (a text_config inside, language_model.* keys, a vision tower and an MTP head); the
# text-only families (Qwen3, Llama, Qwen3-MoE) need nothing.
CONFIG_ADAPTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"qwen3_5": _qwen3_5_text}
KEY_ADAPTERS: dict[str, Callable[[dict[str, Tensor]], dict[str, Tensor]]] = {"qwen3_5": _qwen3_5_keys}


def _read_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        return json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a dict, a path to config.json or a directory, got {type(config).__name__}")


def _arch_of(data: Mapping[str, Any], arch: str | None) -> str:
    if arch is None:
        mt = data.get("model_type") or (data.get("text_config") or {}).get("model_type")
        arch = target_arch_of(mt) if mt else None
        if arch is None:
            raise ValueError(f"config model_type {mt!r} names no target arch; give arch= "
                             f"(one of {sorted(a.name for a in ARCHS.values() if a.target)})")
    if arch not in ARCHS or not ARCHS[arch].target or not ARCHS[arch].hf_causal_lm:
        raise ValueError(f"arch {arch!r} is not a target transformers builds "
                         f"(targets: {sorted(a.name for a in ARCHS.values() if a.target)})")
    return arch


def load_config(config: Any, arch: str | None = None):
    """The arch's transformers config (``ARCHS[arch].hf_config``) from a dict, a config.json path, a directory
    holding one, or a config object already. ``arch`` None: the arch whose ``model_types`` holds the config's
    ``model_type``. A config whose ``model_type`` is another family's is refused, never read as this one."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        arch = _arch_of({"model_type": config.model_type}, arch)
        cls = getattr(transformers, ARCHS[arch].hf_config)
        if not isinstance(config, cls):
            raise ValueError(f"expected a {cls.__name__} for arch {arch!r}, got {type(config).__name__}")
        return config
    data = _read_config(config)
    arch = _arch_of(data, arch)
    data = CONFIG_ADAPTERS.get(arch, lambda d: d)(data)
    cls = getattr(transformers, ARCHS[arch].hf_config)
    mt = data.pop("model_type", cls.model_type)
    if mt != cls.model_type:
        raise ValueError(f"expected a {cls.__name__} config (model_type {cls.model_type!r}) for arch {arch!r}, "
                         f"got model_type {mt!r}")
    return cls.from_dict(data)


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


def build_target(
    config: Mapping[str, Any] | str | Path,
    weights: str | Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_implementation: str = "sdpa",
    arch: str | None = None,
):
    """Build the target arch's causal LM (``ARCHS[arch].hf_causal_lm``) in eval mode on ``device`` with
    parameters in ``dtype``.

    ``config``: a dict, a path to config.json, or a directory with one; ``arch`` None takes the arch from its
    ``model_type``.
    ``weights``: a directory (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``) or one ``.safetensors`` file, loaded with
    safetensors and checked strictly (missing or unexpected keys raise; a tied lm_head may be absent);
    ``None`` keeps transformers' random init, which the caller seeds (``torch.manual_seed``).
    ``attn_implementation``: transformers' attention interface ("sdpa", "eager",
    "flash_attention_2"; the last needs the flash-attn package and a CUDA device).
    Never touches the network.
    """
    _offline()
    import transformers

    data = config if not isinstance(config, (str, Path, Mapping)) else _read_config(config)
    arch = _arch_of({"model_type": data.model_type} if isinstance(data, transformers.PretrainedConfig) else data, arch)
    cfg = load_config(data, arch)
    causal_lm = getattr(transformers, ARCHS[arch].hf_causal_lm)
    device = torch.device(device)
    with torch.device(device):
        # _from_config builds the parameters directly in `dtype` (no fp32 detour)
        model = causal_lm._from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    if weights is not None:
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        state = KEY_ADAPTERS.get(arch, lambda s: s)(_read_safetensors(Path(weights)))
        if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"weights {weights} do not match the config: missing {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}, unexpected {result.unexpected_keys[:8]}"
                f"{'...' if len(result.unexpected_keys) > 8 else ''}"
            )
        if tied:
            model.tie_weights()
    model.eval()
    return model


def _weights_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / n for n in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise FileNotFoundError(f"no model.safetensors(.index.json) under {path}")


HEADS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def build_target_heads(config: Mapping[str, Any] | str | Path, weights: str | Path, dtype: torch.dtype,
                       device: torch.device | str, arch: str | None = None):
    """The target's causal LM with only its embedding, final norm and lm_head materialised on ``device`` (the
    rest stays on the meta device: no memory, never run), their weights read from ``weights`` by name (only those
    tensors are read). What a process that never runs the target's body needs: the modules a drafter borrows
    (run --hidden-states). The three modules equal those of ``build_target`` with the same weights."""
    from safetensors import safe_open

    _offline()
    import transformers

    data = _read_config(config)
    arch = _arch_of(data, arch)
    cfg = load_config(data, arch)
    causal_lm = getattr(transformers, ARCHS[arch].hf_causal_lm)
    with torch.device("meta"):
        model = causal_lm._from_config(cfg, dtype=dtype)
    adapt = KEY_ADAPTERS.get(arch, lambda s: s)
    state: dict[str, Tensor] = {}
    for f in _weights_files(Path(weights)):
        with safe_open(str(f), "pt") as fh:
            names = adapt({k: k for k in fh.keys()})   # noqa: SIM118 (safe_open is not a mapping); ours -> theirs
            for ours, theirs in names.items():
                if ours in HEADS:
                    state[ours] = fh.get_tensor(theirs)
    if "lm_head.weight" not in state and bool(getattr(cfg, "tie_word_embeddings", False)):
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    missing = sorted(k for k in HEADS if state.get(k) is None)
    if missing:
        raise ValueError(f"weights {weights} have no {', '.join(missing)}")
    device = torch.device(device)
    for mod, key in ((embedding(model), "model.embed_tokens.weight"), (final_norm(model), "model.norm.weight"),
                     (lm_head(model), "lm_head.weight")):
        mod.to_empty(device=device)
        mod.weight.data.copy_(state[key].to(dtype))
        mod.requires_grad_(False)
    model.eval()
    return model


# --------------------------------------------------------------------------- module accessors
def final_norm(model) -> nn.Module:
    """The target's own final RMSNorm (``model.model.norm``): ``(1 + w) * x/rms(x)`` where the arch's
    ``norm_plus_one`` (Qwen3.5), ``w * x/rms(x)`` otherwise (Qwen3, Llama, Qwen3-MoE)."""
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
    holding one), with ``<|endoftext|>`` (Qwen) or ``<|end_of_text|>`` (Llama 3) as eos and pad, and
    ``<|mask|>`` as mask token, when the vocabulary has them. ``.backend_tokenizer`` is the raw
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
    eos = next((t for t in EOS_TOKENS if t in vocab), None)
    if eos is not None:
        special.update(eos_token=eos, pad_token=eos)
    if MASK_TOKEN in vocab:
        special["mask_token"] = MASK_TOKEN
    return PreTrainedTokenizerFast(tokenizer_object=raw, **special)


def mask_token_rule(tokenizer, vocab_size: int) -> tuple[int, str]:
    """(id, why): the mask token a drafter for a target with this tokenizer and embedding size should use
    (docs/drafter.md, "The mask token"). First match: the tokenizer's ``<|mask|>``; an embedding row past the
    tokenizer's last token (Qwen3's embedding has 151,936 rows for 151,669 tokens: a row no text ever uses);
    the first unused reserved special token (Llama 3's ``<|reserved_special_token_0|>``); else the pad token
    (SpecForge's fallback, specforge/training/model_utils.py ``resolve_mask_token_id``), which text also uses."""
    vocab = tokenizer.get_vocab()
    if MASK_TOKEN in vocab and vocab[MASK_TOKEN] < vocab_size:
        return vocab[MASK_TOKEN], f"the tokenizer's {MASK_TOKEN}"
    n = len(tokenizer)
    if n < vocab_size:
        return n, f"embedding row {n}: the first past the tokenizer's {n:,} tokens, which no text uses"
    reserved = sorted((i, t) for t, i in vocab.items() if "reserved" in t and i < vocab_size)
    if reserved:
        return reserved[0][0], f"{reserved[0][1]}, a reserved special token no text uses"
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id), ("the pad token (the vocabulary has no spare token: the drafter's mask "
                                            "is then a token that text also uses)")
    raise ValueError("the tokenizer has no <|mask|>, no spare embedding row, no reserved token and no pad token")
