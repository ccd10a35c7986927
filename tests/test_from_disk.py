"""A run from the hidden-state cache (run --hidden-states, docs/offline.md): what check predicts for it (the
drafter side's devices, the cache's loader on the host; NOTE [From-disk memory], analysis/from_disk.py) against
what the live tracker measures."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from dflash_graph.analysis.from_disk import LoaderMemory
from dflash_graph.cli.main import main

TINY = "graphs/tiny.toml"
SMALL = ["--set", "train.eval_every=0", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """4 tiny samples (2 steps of 2 replicas) in one shard: the whole cache is read before the first node runs,
    which is what the measurement once missed (the received tensors were never charged to the drafter device)."""
    import os

    root = tmp_path_factory.mktemp("from_disk")
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parent.parent)
    try:
        assert main(["capture", TINY, "--out", str(root / "cache"), "--samples", "4", "--no-progress",
                     "--set", "capture.shard_samples=4", "--set", "train.eval_every=0"]) == 0
    finally:
        os.chdir(cwd)
    return root / "cache"


def test_from_disk_drafter_memory_is_checks(cache, in_repo, tmp_path):
    """check's drafter-device peak for a run from disk against the live tracker's (exec/memtrack.LiveTracker),
    held to the tolerance of the online run (tests/test_run.py): check errs low by at most 0.02% (the few bytes
    the tracker sees before the drafter's first node), never high. Before the received tensors were charged at
    their transfer's receive, this cache measured 261,112 B (2.8%) under check. The target devices t0 and t1 are
    given 1 MiB each: online they do not fit; from disk they do not exist, so the run is not refused."""
    out = tmp_path / "disk"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["run", TINY, "--steps", "2", "--out", str(out), *SMALL, "--hidden-states", str(cache),
                     "--set", "devices.t0.capacity=1MiB", "--set", "devices.t1.capacity=1MiB"]) == 0
    mem = json.loads((out / "memory.json").read_text())
    draft = mem["devices"]["draft"]
    assert set(mem["devices"]) == {"draft"}
    gap = draft["measured_peak_bytes"] - draft["predicted_peak_bytes"]
    assert 0 <= gap <= 2e-4 * draft["predicted_peak_bytes"], draft
    # node by node, the cut's transfers and the drafter hold what check says, to the same few bytes
    nodes = {n: v["draft"]["measured_peak_bytes"] - v["draft"]["predicted_peak_bytes"]
             for n, v in mem["nodes"].items() if "draft" in v}
    assert nodes["drafter"] == nodes["features_tx"] and 0 <= nodes["features_tx"] < 1024, nodes
    # the loader: the training process holds the shard being consumed (its tensors, under its size on disk);
    # check's bound (4 shards for 1 worker with prefetch 2) is above it
    shard = json.loads((cache / "manifest.json").read_text())["shards"][0]["bytes"]
    src = mem["host_source"]
    assert 0.99 * shard <= src["measured_in_process_peak_bytes"] <= shard
    assert src["predicted_peak_bytes"] == 4 * shard
    # what the run printed: the drafter device alone, and the host with the loader
    text = said.getvalue()
    table = text.split("host memory:")[0]
    assert "  draft " in table and "  t0 " not in table and "  t1 " not in table
    assert "the hidden-state loader's 4 shards of" in text


def test_from_disk_refused_when_the_loader_does_not_fit_the_host(cache, in_repo, tmp_path, capsys):
    """The loader's shards count against the host's memory: a host too small for them is refused before any
    training (exit 1, as any predicted OOM), with what to change."""
    assert main(["run", TINY, "--steps", "2", "--out", str(tmp_path / "r"), *SMALL, "--hidden-states", str(cache),
                 "--host-memory", "12MiB"]) == 1
    err = capsys.readouterr().err
    assert "OOM on host memory: the peak of draft (CPU) and the hidden-state loader's 4 shards of" in err
    assert "--loader-workers 0 holds 2" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_loader_bound():
    """NOTE [From-disk memory]: P * W outstanding (torch's DataLoader), one being decoded per worker, one
    consumed; in the training process alone, 2."""
    assert LoaderMemory(100, 0, 0).shards == 2
    assert LoaderMemory(100, 1, 2).shards == 4
    assert LoaderMemory(100, 4, 2).bytes == 13 * 100
