"""The drafter's objective: the loss params a preset sets, each reference's defaults, and how a loss node's params
resolve (docs/drafter.md, "The objective"). Pure Python: the loss ops' declarations (ops/catalog.py), their costs
(ops/costs.py) and their torch implementations (ops/torch_impl.py) all read it from here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the loss params an objective preset sets, and the project's own defaults for them
OBJECTIVE_DEFAULTS: dict[str, Any] = {"kind": "kl", "gamma": 7.0, "labels": "verifier", "normalize": "weights",
                                      "weighting": "decay", "dpace_alpha": 0.5}

#: each reference's defaults for a DFlash drafter (the final norm, the fourth choice, is the graph's: the drafter's
#: own trainable norm where its `shares` leave `norm` out; docs/drafter.md "The objective"):
#: speculators 0.9.0 `train/config/schema.py` (TrainConfig._resolve_derived_defaults: loss_fn ce and
#: per_position_loss_weight dpace for dflash; DFlashArgs: dpace_alpha 0.5, dflash_decay_gamma 4.0) and
#: `losses/utils.py` loss_function (sum over the scored slots' count); SpecForge 0.2.0 `config/schema.py`
#: (loss_type "dflash", loss_decay_gamma None: no decay) and `algorithms/common/dflash_family_model.py`
#: OnlineDFlashModel.forward (labels input_ids[anchor + k], cross-entropy, over the weights' sum).
OBJECTIVE_PRESETS: dict[str, dict[str, Any]] = {
    "own": {},
    "speculators": {"kind": "ce", "gamma": 4.0, "labels": "verifier", "normalize": "count", "weighting": "dpace",
                    "dpace_alpha": 0.5},
    "specforge": {"kind": "ce", "labels": "data", "normalize": "weights", "weighting": "uniform"},
}


#: the fourth choice of a preset: the final norm. The references' drafters train their own (speculators 0.9.0
#: `models/dflash/core.py` DFlashDraftModel: `self.norm = Qwen3RMSNorm(...)`; SpecForge 0.2.0 DFlashDraftModel.
#: forward returns `self.norm(hidden_states)`); a graph declares it on the drafter (`shares` without `norm`)
OWN_NORM = {"speculators": "speculators' DFlashDraftModel trains its own final norm (models/dflash/core.py)",
            "specforge": "SpecForge's DFlashDraftModel trains its own final norm (DFlashDraftModel.forward)"}


def trains_own(params: Mapping[str, Any]) -> Mapping[str, str]:
    name = params.get("objective", "own")
    return {"norm": f"objective = {name!r}: {OWN_NORM[name]}"} if name in OWN_NORM else {}


def resolve_objective(params: Mapping[str, Any]) -> dict[str, Any]:
    """The loss node's objective: its params, with a preset's values where `objective` names one. A param set to
    something other than both the project's default and the preset's value is refused (ValueError, with the fix),
    as are combinations no reference defines (D-PACE or data labels with a loss other than ce)."""
    name = params.get("objective", "own")
    preset = OBJECTIVE_PRESETS[name]
    out = {k: params.get(k, d) for k, d in OBJECTIVE_DEFAULTS.items()}
    for k, v in preset.items():
        if out[k] != OBJECTIVE_DEFAULTS[k] and out[k] != v:
            raise ValueError(f"objective = {name!r} sets {k} = {v!r}, but the node sets {k} = {out[k]!r}; "
                             f"fix: drop {k} from the node's params, or set objective = \"own\" and each choice")
        out[k] = v
    if out["kind"] != "ce" and (out["weighting"] == "dpace" or out["labels"] == "data"):
        why = "weighting = 'dpace'" if out["weighting"] == "dpace" else "labels = 'data'"
        raise ValueError(f"{why} needs kind = 'ce' (got {out['kind']!r}): D-PACE weighs the drafter's probability "
                         "of one label, and the data gives one token, not a distribution; fix: set kind = \"ce\"")
    return out
