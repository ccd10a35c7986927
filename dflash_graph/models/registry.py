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
                 loads_weights: bool = False, trains: bool = False, assumptions: str | None = None,
                 model_types: tuple[str, ...] = (), target: bool = True, label: str = "",
                 hf_config: str = "", hf_causal_lm: str = "", norm_plus_one: bool = False,
                 kernel_notes: str | None = None, published_keys: frozenset[str] = frozenset()):
        self.name, self._module, self._dims_class, self.components, self.doc = name, module, dims_class, components, doc
        self.loads_weights, self.trains, self._assumptions = loads_weights, trains, assumptions
        # NOTE [Arch from model_type]: the HF `model_type` values a config of this arch carries (transformers'
        # config classes' `model_type`). A target arch is found from them when a graph omits `arch`; a drafter
        # arch is always declared (its config names the type of its layers, not what it is).
        self.model_types, self.target, self.label = model_types, target, label or name
        # NOTE [Target classes]: a target runs through transformers' own classes, named here (run, eval and the
        # tracer build them by name; nothing else in dflash-graph knows a family's classes). `norm_plus_one`: the
        # family's RMSNorm scales by (1 + w) (Qwen3.5), not w (Qwen3, Llama): the export writes the drafter's
        # plain norm.weight from it.
        self.hf_config, self.hf_causal_lm, self.norm_plus_one = hf_config, hf_causal_lm, norm_plus_one
        self._kernel_notes = kernel_notes
        # keys the family's published config.json files carry that transformers' config class no longer has
        # (Qwen3-30B-A3B's max_window_layers): accepted, never read
        self.published_keys = published_keys

    def kernel_notes(self, models: Mapping[str, Any]) -> list[str]:
        """Notes on the kernels a prediction assumed for these models of this arch that differ here ([] if none)."""
        return getattr(self.module, self._kernel_notes)(models) if self._kernel_notes else []

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
        return self.model_keys | HF_RUNTIME_KEYS | self.published_keys

    @property
    def model_keys(self) -> frozenset[str]:
        """The config keys the cost model reads."""
        return self.module.config_keys(self.name) if hasattr(self.module, "config_keys") else self.module.CONFIG_KEYS

    def dims(self, config: Mapping[str, Any]) -> Any:
        make = getattr(self.module, self._dims_class)
        return make.from_config(config, arch=self.name) if getattr(make, "per_arch", False) else make.from_config(config)

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
    "eos_token_id", "rope_theta", "rope_scaling",
})

ARCHS: dict[str, Arch] = {
    "qwen3_5": Arch("qwen3_5", "dflash_graph.models.qwen3_5", "Qwen35Dims", ("embed", "layers", "norm", "lm_head"),
                    "Qwen3.5 / 3.6 text model (transformers Qwen3_5ForCausalLM).", loads_weights=True,
                    assumptions="forward_assumptions", model_types=("qwen3_5", "qwen3_5_text"),
                    label="Qwen3.5 / 3.6 dense", hf_config="Qwen3_5TextConfig", hf_causal_lm="Qwen3_5ForCausalLM",
                    norm_plus_one=True, kernel_notes="kernel_notes"),
    # Targets whose memory is a program derived from transformers' own code (models/decoder.py,
    # models/programs/): adding a dense family is an entry here and its derived program (tools/derive_programs.py)
    "qwen3": Arch("qwen3", "dflash_graph.models.decoder", "DecoderDims", ("embed", "layers", "norm", "lm_head"),
                  "Qwen3 dense text model (transformers Qwen3ForCausalLM): Qwen3-4B, Qwen3-8B.", loads_weights=True,
                  assumptions="forward_assumptions", model_types=("qwen3",), label="Qwen3 dense",
                  hf_config="Qwen3Config", hf_causal_lm="Qwen3ForCausalLM"),
    "llama": Arch("llama", "dflash_graph.models.decoder", "DecoderDims", ("embed", "layers", "norm", "lm_head"),
                  "Llama 3 text model (transformers LlamaForCausalLM): Llama-3.1-8B.", loads_weights=True,
                  assumptions="forward_assumptions", model_types=("llama",), label="Llama 3",
                  hf_config="LlamaConfig", hf_causal_lm="LlamaForCausalLM"),
    "qwen3_moe": Arch("qwen3_moe", "dflash_graph.models.decoder", "DecoderDims",
                      ("embed", "layers", "norm", "lm_head"),
                      "Qwen3 MoE text model (transformers Qwen3MoeForCausalLM): Qwen3-30B-A3B.", loads_weights=True,
                      assumptions="forward_assumptions", model_types=("qwen3_moe",), label="Qwen3-MoE",
                      hf_config="Qwen3MoeConfig", hf_causal_lm="Qwen3MoeForCausalLM",
                      published_keys=frozenset({"max_window_layers"})),
    # a DFlash drafter's config.json (z-lab's, and the one `run` exports) says model_type "qwen3": its layers
    "dflash": Arch("dflash", "dflash_graph.models.dflash", "DFlashDims", ("fc", "hidden_norm", "layers", "norm"),
                   "DFlash block-diffusion drafter; embed and lm_head come from `shares`, and the final norm too "
                   "unless the drafter trains its own.", trains=True,
                   loads_weights=True,   # a published DFlash draft checkpoint: models/published.py
                   model_types=("qwen3",), target=False, label="DFlash drafter"),
}

#: the archs a target op (a forward, hook_capture, the final norm, lm_head) accepts
TARGET_ARCHS: tuple[str, ...] = tuple(name for name, a in ARCHS.items() if a.target)

#: Target families transformers has that dflash-graph does not model yet, by model_type (their arch names are the
#: same, less a `_text` suffix): a graph that names one is refused with what is supported, never "unknown".
COMING: dict[str, str] = {
    "qwen3_5_moe": "Qwen3.5 / 3.6 MoE: Qwen3.6-35B-A3B",
    "qwen3_5_moe_text": "Qwen3.5 / 3.6 MoE: Qwen3.6-35B-A3B",
    "qwen2": "Qwen2 / Qwen2.5",
    "gpt_oss": "gpt-oss",
}

#: Config keys that only other families' configs carry (transformers 5.24's config classes, less the keys of
#: Qwen3_5TextConfig and of the arch itself): a config holding one is another model's, whatever it says.
FAMILY_KEYS: dict[str, frozenset[str]] = {
    "qwen3": frozenset({"sliding_window", "use_sliding_window", "max_window_layers"}),
    "qwen2": frozenset({"sliding_window", "use_sliding_window", "max_window_layers"}),
    "llama": frozenset({"mlp_bias", "pretraining_tp"}),
    "qwen3_moe": frozenset({"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
                            "num_experts", "num_experts_per_tok", "num_local_experts", "output_router_logits",
                            "router_aux_loss_coef", "sliding_window", "use_sliding_window"}),
    "gpt_oss": frozenset({"num_local_experts", "num_experts_per_tok", "output_router_logits",
                          "router_aux_loss_coef", "sliding_window", "swiglu_alpha", "swiglu_limit"}),
    "qwen3_5_moe_text": frozenset({"moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                   "output_router_logits", "router_aux_loss_coef", "shared_expert_intermediate_size"}),
}


def kernel_notes(models: Mapping[str, Any]) -> list[str]:
    """Each arch's notes on the kernels its models' predictions assumed that differ from what runs here."""
    return [note for arch in ARCHS.values() for note in
            arch.kernel_notes({n: m for n, m in models.items() if m.spec.arch == arch.name})]


def target_arch_of(model_type: str) -> str | None:
    """The modelled target arch whose configs carry this model_type, or None."""
    return next((a.name for a in ARCHS.values() if a.target and model_type in a.model_types), None)


def model_types_of(config: Mapping[str, Any]) -> list[tuple[tuple[str, ...], Any]]:
    """Where a config names its model_type: (key path in the config, value), the top level's and a multimodal
    config's text_config's."""
    out = [(("model_type",), config["model_type"])] if "model_type" in config else []
    text = config.get("text_config")
    if isinstance(text, Mapping) and "model_type" in text:
        out.append((("text_config", "model_type"), text["model_type"]))
    return out


def foreign_keys(arch: Arch, config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Keys of `config` (and of its text_config) that only other families' configs carry: key -> those
    families' model_types."""
    own = frozenset().union(*(FAMILY_KEYS.get(t, frozenset()) for t in arch.model_types)) | arch.config_keys
    keys = set(config)
    if isinstance(config.get("text_config"), Mapping):
        keys |= set(config["text_config"])
    out: dict[str, list[str]] = {}
    for fam, fk in FAMILY_KEYS.items():
        for k in sorted((keys & fk) - own):
            out.setdefault(k, []).append(fam)
    return out


def supported_text() -> str:
    """The targets dflash-graph models, and those coming: what an error about an arch or model_type lists."""
    have = "; ".join(f"arch '{a.name}' ({a.label}; model_type {' or '.join(a.model_types)})"
                     for a in ARCHS.values() if a.target)
    coming = ", ".join(dict.fromkeys(COMING))
    return f"supported targets: {have}; not modelled yet: {coming}"


def not_modelled(what: str) -> str:
    """Why a known family's model_type or arch is refused."""
    return f"{what} is not modelled yet: dflash-graph models {', '.join(TARGET_ARCHS)} targets"

