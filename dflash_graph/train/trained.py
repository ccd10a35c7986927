"""A trained run, loaded back: the graph's target (with its weights) and the drafter (with the checkpoint's), for
`dflash-graph eval` and `dflash-graph export`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import GraphError, Location, Problem
from ..exec.models import ModelStore
from ..models.registry import ARCHS
from ..rewrite.pipeline import Plan


def drafter_names(plan: Plan) -> tuple[str, str]:
    """(drafter model, target model): the trainable dflash model and the model it takes its embedding from."""
    models = plan.typed.ctx.models
    spec = plan.typed.ctx.spec
    dr = [n for n, m in models.items() if ARCHS[m.spec.arch].trains]
    if len(dr) != 1:
        raise GraphError(Problem(f"the graph has {len(dr)} dflash models; eval and export need exactly one",
                                 spec.loc("models")))
    target = models[dr[0]].component_owner("embed").split(".")[0]
    if target == dr[0] or not ARCHS[models[target].spec.arch].target:
        raise GraphError(Problem(f"drafter '{dr[0]}' does not take its embedding from a target model",
                                 spec.loc("models", dr[0], "shares"),
                                 expected="a model of a target arch (" + ", ".join(
                                     a.name for a in ARCHS.values() if a.target) + ")",
                                 actual=f"'{target}'" + ("" if target == dr[0] else
                                                         f" (arch '{models[target].spec.arch}')"),
                                 hint='shares = { embed = "target.embed", ... }'))
    return dr[0], target


def checkpoint_file(ckpt: Path, drafter: str, flag: str) -> Path:
    """The drafter's weights in the newest checkpoint that verifies (train/checkpoint.py, newest_good): `ckpt` is
    a run's --out directory, or one checkpoint directory (its checkpoint/ link or a checkpoints/step-N)."""
    from .checkpoint import newest_good

    ck = newest_good(ckpt, flag, doing="using")
    f = ck / f"{drafter}.safetensors"
    if not f.is_file():
        saved = sorted(p.stem for p in ck.glob("*.safetensors"))
        raise GraphError(Problem(f"checkpoint {ck} has no weights for the drafter '{drafter}' this graph trains "
                                 f"(it holds: {', '.join(saved) or 'none'})", Location(str(ck)),
                                 expected=str(f), hint="use the graph (and --set overrides) the run was trained with"))
    return f


def mismatches(module, state: dict) -> str:
    """Each tensor whose shape differs between `module` and a checkpoint's `state`, and each one only one has."""
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    out = [f"{k}: checkpoint {list(theirs[k])}, graph {list(mine[k])}" for k in sorted(mine.keys() & theirs.keys())
           if mine[k] != theirs[k]]
    out += [f"{k}: only in the checkpoint" for k in sorted(theirs.keys() - mine.keys())]
    out += [f"{k}: not in the checkpoint" for k in sorted(mine.keys() - theirs.keys())]
    return "; ".join(out[:8]) + (f"; and {len(out) - 8} more" if len(out) > 8 else "")


class Trained:
    def __init__(self, plan: Plan, ckpt: Path, device: str = "cpu", flag: str = "--checkpoint"):
        from .checkpoint import read_weights

        self.plan = plan
        self.drafter_name, self.target_name = drafter_names(plan)
        self.dims = plan.typed.ctx.models[self.drafter_name].dims
        weights = checkpoint_file(ckpt, self.drafter_name, flag)   # a bad checkpoint is found before any model is built
        self.store = ModelStore(plan.typed, {d: device for d in plan.typed.ctx.spec.devices},
                                int(plan.typed.ctx.spec.train["seed"]))
        self.target = self.store.full(self.target_name, device)
        self.drafter = self.store.drafter(self.drafter_name, device)
        state = read_weights(weights)
        try:
            self.drafter.load_state_dict({k: v.to(device) for k, v in state.items()})
        except RuntimeError as e:
            raise GraphError(Problem("the checkpoint does not fit this graph's drafter", Location(str(weights)),
                                     expected="the tensors and shapes of this graph's drafter",
                                     actual=mismatches(self.drafter, state) or str(e).splitlines()[0],
                                     hint="use the graph (and --set overrides) the run was trained with")) from None
        self.drafter.eval()
        self.drafter.requires_grad_(False)

    @property
    def norm_weight(self) -> torch.Tensor:
        from ..models.nn.target import final_norm

        return final_norm(self.target).weight.detach()

    @property
    def norm_plus_one(self) -> bool:
        """The target's final norm scales by (1 + w) (models/registry.py `Arch.norm_plus_one`)."""
        return ARCHS[self.plan.typed.ctx.models[self.target_name].spec.arch].norm_plus_one
