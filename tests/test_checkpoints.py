"""Checkpoints survive crashes and corruption (train/checkpoint.py, NOTE [Atomic checkpoints]): the last K are
kept, a corrupted newest one is named and the previous good one used, trainer.pt is read with weights_only=True,
and a writer SIGKILLed at 20 random moments always leaves a checkpoint that verifies and holds exactly the state
of the step it names."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_graph.errors import GraphError
from dflash_graph.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent


def parts(fill: float = 0.0):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return m, opt, sched, torch.Generator().manual_seed(1)


def save_step(d: Path, step: int, keep: int = 3) -> Path:
    m, opt, sched, gen = parts(float(step))
    return checkpoint.save(d, step, {"drafter": m}, opt, sched, {"pos": step}, gen, {"graph": "t"}, keep=keep)


def test_save_load_restore_and_keep(tmp_path):
    for s in (1, 2, 3, 4, 5):
        save_step(tmp_path, s, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]
    assert (tmp_path / "checkpoint").resolve().name == "step-00000005"
    state, ck = checkpoint.load(tmp_path)
    assert state["step"] == 5 and state["data"] == {"pos": 5}
    m, opt, sched, gen = parts(0.0)
    checkpoint.restore(ck, {"drafter": m}, opt, sched, gen)
    assert torch.all(m.weight == 5.0)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert set(manifest["files"]) == {"drafter.safetensors", "trainer.pt", "state.json"}


@pytest.mark.parametrize("damage", ["truncate", "flip", "state_json", "manifest", "missing"])
def test_corrupted_newest_falls_back_to_the_previous(tmp_path, damage, capsys):
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    ck = tmp_path / "checkpoints" / "step-00000002"
    w = ck / "drafter.safetensors"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "flip":
        b = bytearray(w.read_bytes())
        b[len(b) - 3] ^= 0xFF
        w.write_bytes(bytes(b))
    elif damage == "state_json":
        (ck / "state.json").write_text("{ not json")
    elif damage == "manifest":
        (ck / "manifest.json").write_text("[")
    else:
        (ck / "trainer.pt").unlink()
    state, used = checkpoint.load(tmp_path)
    assert state["step"] == 1 and used.name == "step-00000001"
    err = capsys.readouterr().err
    assert "step-00000002 is unusable" in err and "resuming from" in err


def test_no_good_checkpoint_is_a_located_error(tmp_path):
    save_step(tmp_path, 1)
    (tmp_path / "checkpoints" / "step-00000001" / "state.json").write_text("")
    with pytest.raises(GraphError) as e:
        checkpoint.load(tmp_path)
    assert "step-00000001 is unusable" in str(e.value)
    with pytest.raises(GraphError, match="no checkpoint in"):
        checkpoint.load(tmp_path / "empty")


def test_trainer_file_is_never_unpickled_as_code(tmp_path):
    """A trainer.pt holding an arbitrary object (with a manifest that matches it) is refused, not run."""
    save_step(tmp_path, 1)
    ck = tmp_path / "checkpoints" / "step-00000001"
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Evil()}, ck / "trainer.pt")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = {"bytes": (ck / "trainer.pt").stat().st_size,
                                       "sha256": checkpoint._sha256(ck / "trainer.pt")}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    _, used = checkpoint.load(tmp_path)
    m, opt, sched, gen = parts()
    with pytest.raises(GraphError, match="weights_only=True"):
        checkpoint.restore(used, {"drafter": m}, opt, sched, gen)
    assert not marker.exists()


def test_leftover_temporaries_are_cleaned(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step-00000009-123").mkdir(parents=True)
    (tmp_path / ".checkpoint.tmp999").mkdir()
    save_step(tmp_path, 1)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")) and not list(tmp_path.glob(".checkpoint.tmp*"))


def test_the_older_layout_still_resumes(tmp_path):
    """A run directory written before checkpoints/ existed: `checkpoint/` is a directory without a manifest."""
    save_step(tmp_path, 3)
    legacy = tmp_path / "old"
    legacy.mkdir()
    src = tmp_path / "checkpoints" / "step-00000003"
    (legacy / "checkpoint").mkdir()
    for f in ("drafter.safetensors", "trainer.pt", "state.json"):
        (legacy / "checkpoint" / f).write_bytes((src / f).read_bytes())
    state, ck = checkpoint.load(legacy)
    assert state["step"] == 3 and ck == legacy / "checkpoint"
    save_step(legacy, 4)           # the old directory becomes a fallback, the link the newest
    assert checkpoint.load(legacy)[0]["step"] == 4 and (legacy / ".checkpoint.old" / "state.json").exists()


def _writer(d: Path, start: int, ready_w: int) -> None:
    """The child: save steps start, start+1, ... until killed (each step's weights filled with the step)."""
    try:
        torch.set_num_threads(1)
        m = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        gen = torch.Generator().manual_seed(0)
        os.write(ready_w, b"r")
        step = start
        while True:
            with torch.no_grad():
                for p in m.parameters():
                    p.fill_(float(step))
            checkpoint.save(d, step, {"drafter": m}, opt, sched, {"pos": step}, gen, {}, keep=2)
            step += 1
    finally:
        os._exit(1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_saves_always_leaves_a_good_checkpoint(tmp_path):
    d = tmp_path / "run"
    rnd = random.Random(11)
    last = 0
    mid_save = 0
    for kill in range(20):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _writer(d, last + 1, w)
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        if kill == 0:                # at least one complete save before the first kill
            while not checkpoint._steps(d):
                time.sleep(0.005)
        time.sleep(rnd.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_save += bool(list((d / "checkpoints").glob(".tmp-*")))   # killed while a save was in flight
        state, ck = checkpoint.load(d)
        assert checkpoint.verify(ck) is None
        assert state["step"] >= last, "a kill never loses a checkpoint that was complete"
        m = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        checkpoint.restore(ck, {"drafter": m}, opt, sched, torch.Generator())
        assert torch.all(m.weight == float(state["step"])), "the checkpoint holds exactly its step's weights"
        last = state["step"]
    assert last >= 2
    assert mid_save >= 5, f"only {mid_save} of 20 kills landed inside a save"
    print(f"20 kills, {mid_save} inside a save; last step {last}")
