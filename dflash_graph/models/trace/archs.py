"""How each supported arch is built from a few dims, and the sizes its programs are fitted and checked at.

An entry names transformers' config and causal-LM classes, maps each dim of the program (the names used in its
expressions) to the config key it sets, gives a base value and two alternates per dim (the fitting design varies
each dim alone, and each pair together), and the config values that are fixed (they change which code runs, not
how big its tensors are: the program holds only for them). Adding a dense arch is an entry here plus its derived
program.
"""

from __future__ import annotations

from typing import Any

import attrs

#: the delta rule's chunk size (transformers' torch_chunk_gated_delta_rule, chunk_size=64)
DELTA_RULE_CHUNK = 64


@attrs.frozen
class ArchSpec:
    arch: str  # the config's model_type
    config_cls: str  # transformers class names
    model_cls: str
    dims: dict[str, str]  # program dim -> config key ("seq" comes from the input)
    base: dict[str, int]  # base value of each dim (and "seq")
    alts: dict[str, tuple[int, int]]  # two other values of each dim
    fixed: dict[str, Any] = attrs.field(factory=dict)  # config values the program holds for
    layers: tuple[str, ...] = ()  # layer_types to trace ((): the arch's default for 2 layers)
    valid: Any = None  # dims -> None or why the combination is not a valid config, or not this program's
    holds_when: tuple[str, ...] = ()  # conditions on the dims the program was derived under (evaluate checks)
    # dims computed from others (programs.derived_values): sizes that are polynomials in a quotient of dims
    derived: dict[str, tuple] = attrs.field(factory=lambda: dict(GROUPS))

    def names(self) -> list[str]:
        """The dims a program's sizes are fitted in: the varied ones and the derived ones."""
        return list(self.alts) + list(self.derived)

    def with_derived(self, values: dict[str, int]) -> dict[str, int]:
        from dflash_graph.models.programs import derived_values

        return dict(values, **derived_values({k: list(v) for k, v in self.derived.items()}, values))

    def conditions(self, packing: str) -> tuple[str, ...]:
        """Where a program of this arch holds: the arch's own conditions and those of sdpa under this packing."""
        return self.holds_when + SDPA_HOLDS_WHEN[packing]

    def admits(self, values: dict[str, int], packing: str) -> bool:
        """Whether a point is a valid config that runs the code the program is derived for (design and checks)."""
        from dflash_graph.models.programs import holds

        if self.valid is not None and self.valid(values) is not None:
            return False
        return all(holds(c, values) for c in self.conditions(packing))

    def config(self, values: dict[str, int], attn: str = "sdpa", layers: list[str] | None = None):
        """transformers' config at these dims; `layers`: the layer types in order (an arch with one layer type:
        that many layers), default the traced layers (two for an arch with one type)."""
        import transformers

        kw = {self.dims[k]: v for k, v in values.items() if k in self.dims}
        kw.update(self.fixed)
        layers = list(layers or self.layers or ("decoder", "decoder"))
        kw["num_hidden_layers"] = len(layers)
        if self.layers:
            kw["layer_types"] = layers
        cfg = getattr(transformers, self.config_cls)(**kw, attn_implementation=attn)
        if hasattr(cfg, "_experts_implementation") and self.arch.endswith("moe"):
            # what PreTrainedModel sets when the config leaves it None (modeling_utils
            # get_correct_experts_implementation: "grouped_mm"); a bare module would fall back to the eager loop
            cfg._experts_implementation = EXPERTS_IMPLEMENTATION
        return cfg

    def model_class(self):
        import transformers

        return getattr(transformers, self.model_cls)


#: where transformers' sdpa_attention_forward (integrations/sdpa_attention.py) runs the code a program is traced
#: with. Without a mask (packing "documents") grouped-query heads go to sdpa with enable_gqa, unless head_dim > 256
#: (then repeat_kv copies k and v). With a mask (packing "mask") repeat_kv always runs: a copy of k and v to
#: `heads` heads, except with one kv head (the expand is a view) or as many kv heads as heads (nothing to repeat).
#: One query token (seq 1) packs the heads instead. Each excluded case is other code: another program.
SDPA_HOLDS_WHEN = {"documents": ("seq > 1", "head_dim <= 256"),
                   "mask": ("seq > 1", "kv_heads != 1", "kv_heads != heads")}

#: what transformers runs for MoE experts by default (modeling_utils.get_correct_experts_implementation)
EXPERTS_IMPLEMENTATION = "grouped_mm"


#: query heads per kv head: sdpa with a mask repeats k and v to [1, kv_heads, groups, seq, head_dim] (repeat_kv)
GROUPS = {"groups": ("div", "heads", "kv_heads")}


def _gqa(v: dict[str, int]) -> str | None:
    if v["heads"] % v["kv_heads"]:
        return "heads must be a multiple of kv_heads"
    if v.get("lin_v_heads", 1) % v.get("lin_k_heads", 1):
        return "lin_v_heads must be a multiple of lin_k_heads"
    if v.get("top_k", 0) > v.get("experts", 1 << 30):
        return "top_k must be at most experts"
    return None


_DENSE_DIMS = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
               "head_dim": "head_dim", "intermediate": "intermediate_size", "vocab": "vocab_size"}
# heads and kv heads: every point repeats kv heads (n_rep > 1) from more than one kv head, as real targets do and
# as packing "mask" needs (SDPA_HOLDS_WHEN); hidden a multiple of heads (LlamaConfig wants it)
_DENSE_BASE = {"hidden": 48, "heads": 12, "kv_heads": 2, "head_dim": 16, "intermediate": 80, "vocab": 300, "seq": 100}
_DENSE_ALTS = {"hidden": (72, 96), "heads": (8, 24), "kv_heads": (3, 4), "head_dim": (24, 32),
               "intermediate": (96, 136), "vocab": (340, 420), "seq": (90, 130)}

ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _DENSE_DIMS, _DENSE_BASE, _DENSE_ALTS,
                      fixed={"tie_word_embeddings": False, "attention_bias": False}, valid=_gqa),
    "llama": ArchSpec("llama", "LlamaConfig", "LlamaForCausalLM", _DENSE_DIMS, _DENSE_BASE, _DENSE_ALTS,
                      fixed={"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
                      valid=lambda v: _gqa(v) or ("LlamaConfig wants hidden a multiple of heads"
                                                  if v["hidden"] % v["heads"] else None)),
    "qwen3_moe": ArchSpec(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict({k: v for k, v in _DENSE_DIMS.items() if k != "intermediate"}, experts="num_experts",
             top_k="num_experts_per_tok", moe_intermediate="moe_intermediate_size"),
        dict({k: v for k, v in _DENSE_BASE.items() if k != "intermediate"}, experts=8, top_k=2, moe_intermediate=40),
        dict({k: v for k, v in _DENSE_ALTS.items() if k != "intermediate"}, experts=(12, 20), top_k=(3, 4),
             moe_intermediate=(56, 72)),
        fixed={"tie_word_embeddings": False, "attention_bias": False, "norm_topk_prob": True,
               "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False},
        valid=_gqa,
        # torch._grouped_mm wants each row of its inputs ([tokens, hidden], [tokens, moe_intermediate]) a multiple
        # of 16 bytes: 8 bf16 elements (transformers' grouped_mm experts fail otherwise; real configs hold)
        holds_when=("hidden % 8 == 0", "moe_intermediate % 8 == 0")),
    "qwen3_5": ArchSpec(
        "qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
        dict(_DENSE_DIMS, lin_k_heads="linear_num_key_heads", lin_v_heads="linear_num_value_heads",
             lin_k_dim="linear_key_head_dim", lin_v_dim="linear_value_head_dim"),
        dict(_DENSE_BASE, lin_k_heads=2, lin_v_heads=6, lin_k_dim=16, lin_v_dim=24, seq=100),
        # head_dim in multiples of 8: the rotary dim is head_dim * partial_rotary_factor (0.25), halved
        dict(_DENSE_ALTS, lin_k_heads=(1, 3), lin_v_heads=(4, 8), lin_k_dim=(20, 32), lin_v_dim=(28, 16),
             seq=(110, 120)),
        fixed={"tie_word_embeddings": False, "attention_bias": False, "linear_conv_kernel_dim": 4},
        layers=("linear_attention", "full_attention"),
        valid=_gqa, holds_when=("lin_v_heads != lin_k_heads",),
        # the delta rule's scan over chunks of 64 tokens; linear value heads per key head (repeat_interleave)
        derived=dict(GROUPS, chunks=("ceildiv", "seq", DELTA_RULE_CHUNK),
                     lin_groups=("div", "lin_v_heads", "lin_k_heads"))),
}

#: seq values for the chunk count (Qwen3.5): the base seq's chunk count, one more, two more, and one inside a chunk
CHUNK_SEQS = (150, 140, 250)
