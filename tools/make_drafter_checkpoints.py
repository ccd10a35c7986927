"""Write the small DFlash draft checkpoints the bad-graph fixtures start from (tests/graphs/bad/drafter_weights_*):
the drafter of tests/graphs/bad/drafter_weights_missing.toml (hidden 32, 1 layer, block 4, mask token 1, target
layers [0, 1] of a 2-layer target), random, in the three shapes a user meets:

* drafter_ckpt/: `dflash-graph export`'s format (z-lab's), float32;
* drafter_ckpt_speculators/: the same tensors as speculators 0.9.0 saves a DFlash drafter (config.json with
  speculators_model_type "dflash", transformer_layer_config, aux_hidden_state_layer_ids = target layers + 1);
* drafter_ckpt_bad_shape/: export's format whose fc.weight is not as wide as its config says.

    python tools/make_drafter_checkpoints.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dflash_graph.models.dflash import DFlashDims
from dflash_graph.models.nn.dflash import DFlashDrafter
from dflash_graph.train.export import export

OUT = Path(__file__).resolve().parent.parent / "tests" / "graphs" / "bad"
CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, block_size=4, mask_token_id=1, target_layer_ids=[0, 1], target_hidden_size=32,
              vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0)


def speculators_config(zlab: dict) -> dict:
    """speculators' DFlashSpeculatorConfig.to_dict() for the same drafter (speculators/config.py,
    speculators/models/dflash/config.py)."""
    layers = {k: v for k, v in zlab.items()
              if k not in ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")}
    d = zlab["dflash_config"]
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layers,
        "draft_vocab_size": zlab["vocab_size"],
        "block_size": d["block_size"],
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in d["target_layer_ids"]],
        "mask_token_id": d["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3_5ForCausalLM"]}},
    }


def main() -> None:
    torch.manual_seed(0)
    dims = DFlashDims.from_config(CONFIG)
    drafter = DFlashDrafter(dims, nn.Embedding(dims.vocab_size, dims.hidden_size))
    norm = torch.zeros(dims.hidden_size)          # a (1 + w) target norm at its init: the plain norm is 1
    zlab = OUT / "drafter_ckpt"
    export(drafter, dims, norm, {"num_hidden_layers": 2, "max_position_embeddings": 64}, zlab, "float32",
           norm_plus_one=True)
    spec = OUT / "drafter_ckpt_speculators"
    spec.mkdir(exist_ok=True)
    shutil.copy(zlab / "model.safetensors", spec / "model.safetensors")
    cfg = json.loads((zlab / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps(speculators_config(cfg), indent=2) + "\n")
    bad = OUT / "drafter_ckpt_bad_shape"
    bad.mkdir(exist_ok=True)
    shutil.copy(zlab / "config.json", bad / "config.json")
    from safetensors.torch import load_file

    sd = load_file(str(zlab / "model.safetensors"))
    sd["fc.weight"] = sd["fc.weight"][:, : dims.hidden_size].contiguous()   # one target layer's width, not two
    save_file(sd, str(bad / "model.safetensors"), {"format": "pt"})
    print("wrote", zlab, spec, bad)


if __name__ == "__main__":
    main()
