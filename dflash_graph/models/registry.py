"""Architectures a graph's `models.<name>.arch` may name. Each has a pure-Python module (no torch) with its
config keys, a Dims class built from a config, and its parameter count per component."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import cached_property
from typing import Any


class Arch:
    """`loads_weights`: `run` loads `models.<name>.weights` for a model of this arch (else the key is refused:
    it would be ignored). `trains`: `run` can train a model of this arch (else `trainable = true` is refused:
    check would count gradients and AdamW state that run never makes)."""

    def __init__(self, name: str, module: str, dims_class: str, components: tuple[str, ...], doc: str,
                 loads_weights: bool = False, trains: bool = False, assumptions: str | None = None):
        self.name, self._module, self._dims_class, self.components, self.doc = name, module, dims_class, components, doc
        self.loads_weights, self.trains, self._assumptions = loads_weights, trains, assumptions

    def assumptions(self, dims: Any, declared: Mapping[str, Any]) -> dict[str, Any]:
        """What check assumes about how a model of this arch runs ({} for an arch that assumes nothing): per key
        `value`, `means` (the words check prints) and `source` ("declared", or the default and why), and
        `not_measured` (parts derived but not measured)."""
        return getattr(self.module, self._assumptions)(dims, declared) if self._assumptions else {}

    def assumption_line(self, dims: Any, declared: Mapping[str, Any]) -> str | None:
        """check's line for those assumptions, or None."""
        a = self.assumptions(dims, declared)
        if not a:
            return None
        keys = [k for k in a if k != "not_measured"]
        tail = (f"; derived from the {' and '.join(a['not_measured'])}, not yet measured"
                if a.get("not_measured") else "")
        return ", ".join(f"{a[k]['means']} ({a[k]['source']})" for k in keys) + tail

    @cached_property
    def module(self):
        return importlib.import_module(self._module)

    @property
    def config_keys(self) -> frozenset[str]:
        """Keys an inline config may use: those the cost model reads, plus the rest of the HF config class's
        fields (read by transformers at run time). A config.json file is not checked key by key: a real
        checkpoint's config carries whatever its exporter wrote."""
        return self.module.CONFIG_KEYS | HF_RUNTIME_KEYS

    def dims(self, config: Mapping[str, Any]) -> Any:
        return getattr(self.module, self._dims_class).from_config(config)

    def component_params(self, dims: Any) -> dict[str, int]:
        # pure in the dims (frozen attrs): the memory model asks for it per node and per rewrite candidate
        try:
            hit = _PARAMS.get((self.name, dims))
        except TypeError:       # unhashable dims
            return self.module.component_params(dims)
        if hit is None:
            if len(_PARAMS) > 256:
                _PARAMS.clear()
            hit = _PARAMS[(self.name, dims)] = dict(self.module.component_params(dims))
        return dict(hit)


_PARAMS: dict[tuple[str, Any], dict[str, int]] = {}


HF_RUNTIME_KEYS = frozenset({
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "rms_norm_eps", "hidden_act",
    "max_position_embeddings", "initializer_range", "use_cache", "attention_dropout", "pad_token_id", "bos_token_id",
    "eos_token_id", "rope_theta", "rope_scaling", "mlp_only_layers",
})

ARCHS: dict[str, Arch] = {
    "qwen3_5": Arch("qwen3_5", "dflash_graph.models.qwen3_5", "Qwen35Dims", ("embed", "layers", "norm", "lm_head"),
                    "Qwen3.5 / 3.6 text model (transformers Qwen3_5ForCausalLM).", loads_weights=True,
                    assumptions="forward_assumptions"),
    "dflash": Arch("dflash", "dflash_graph.models.dflash", "DFlashDims", ("fc", "hidden_norm", "layers"),
                   "DFlash block-diffusion drafter; embed, norm and lm_head come from `shares`.", trains=True),
}
