"""Checkpoints: drafter weights in safetensors, optimizer + scheduler + RNG + data position in a torch file, a
small JSON manifest. Written to a temporary directory and renamed into place, so a crash mid-write never leaves
a half checkpoint where --resume would read it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def save(dirpath: Path, step: int, drafters: dict[str, torch.nn.Module], optimizer, scheduler,
         data_state: dict, generator: torch.Generator, extra: dict[str, Any], masters=()) -> Path:
    final = dirpath / "checkpoint"
    tmp = dirpath / f".checkpoint.tmp{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, m in drafters.items():
        save_file({k: v.detach().contiguous().cpu() for k, v in m.state_dict().items()}, str(tmp / f"{name}.safetensors"),
                  metadata={"step": str(step), "format": "dflash-graph drafter"})
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "generator": generator.get_state(), "torch_rng": torch.get_rng_state(),
                "masters": [m.detach().cpu() for m in masters]}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "data": data_state, **extra}, indent=2))
    old = dirpath / ".checkpoint.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    return final


def load(dirpath: Path) -> tuple[dict, Path]:
    ck = dirpath / "checkpoint"
    if not (ck / "state.json").exists():
        from ..errors import GraphError, Location, Problem

        raise GraphError(Problem(f"no checkpoint in {dirpath}", Location(str(dirpath)),
                                 hint="--resume takes the --out directory of an earlier run"))
    return json.loads((ck / "state.json").read_text()), ck


def restore(ck: Path, drafters: dict[str, torch.nn.Module], optimizer, scheduler, generator, masters=()) -> None:
    for name, m in drafters.items():
        state = load_file(str(ck / f"{name}.safetensors"))
        m.load_state_dict({k: v.to(next(m.parameters()).device) for k, v in state.items()})
    blob = torch.load(ck / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    generator.set_state(blob["generator"])
    with torch.no_grad():
        for m, saved in zip(masters, blob.get("masters", [])):
            m.copy_(saved.to(m.device))
    torch.set_rng_state(blob["torch_rng"])
