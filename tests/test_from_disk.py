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


def test_drafter_launch_is_the_drafter_sides_ranks(in_repo):
    """NOTE [From disk under torchrun]: tiny_dp's drafter side is d0, d1 (graph ranks 2, 3): a run from the cache
    launches 2 ranks, d0 on 0 and d1 on 1, with no transfer between ranks; tiny's drafter alone is 1 rank."""
    from dflash_graph.analysis.capture import find_cut
    from dflash_graph.analysis.from_disk import drafter_launch
    from dflash_graph.rewrite.pipeline import compile_graph

    for graph, ranks in (("graphs/tiny_dp.toml", {"d0": 0, "d1": 1}), (TINY, {"draft": 0})):
        typed = compile_graph(graph).typed
        launch = drafter_launch(typed, find_cut(typed).drafter_devices)
        assert {d: v.rank for d, v in launch.devices.items()} == ranks
        assert launch.world_size == len(ranks) and launch.transfers == () and launch.replicas == 2


def test_a_rank_reads_its_replicas_samples(cache, in_repo):
    """Under torchrun a drafter rank reads the samples of its replicas only, by the online split (sample i is
    replica i % R): replica 1 of tiny gets samples 1 and 3, then 1 again on the next pass, each the tensors the
    one-process reader hands over for that sample."""
    import torch

    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.hidden_cache import CacheSource

    plan = compile_graph(TINY, ["train.eval_every=0"])
    every = CacheSource(plan, cache, workers=0)
    samples = [every.next_inbox() for _ in range(4)]
    one = CacheSource(plan, cache, workers=0, own_replicas=frozenset({1}))
    got = [one.next_inbox() for _ in range(3)]
    for g, i in zip(got, (1, 3, 1)):
        assert set(g) == set(samples[i]) and all(torch.equal(g[k], samples[i][k]) for k in g), i
    every.close()
    one.close()


@pytest.mark.slow     # about 90 s on the shared 2-core machine: a 4-rank and a 2-rank launch, each importing torch
def test_from_disk_under_launch_equals_the_online_data_parallel_run(in_repo, tmp_path):
    """`dflash-graph launch --nproc-per-node 2 run graphs/tiny_dp.toml --hidden-states DIR`: the drafter side's 2
    ranks (d0, d1), each reading its replica's samples from a cache captured in one process, train the drafter under
    DDP and give the online tiny_dp run's (4 ranks) metrics step for step, exactly (the tolerance tests/test_dp.py
    states for tiny_dp: 0). Every process of each launch is killed when the test ends, pass or fail."""
    import os
    import subprocess
    import sys

    from test_capture import _descendants
    from test_distributed import session_gone, torchrun
    from test_run import read_metrics

    small = ["--set", "train.eval_every=0", "--set", "capture.shard_samples=1"]
    cache, online, disk = tmp_path / "cache", tmp_path / "online", tmp_path / "disk"
    assert main(["capture", "graphs/tiny_dp.toml", "--out", str(cache), "--samples", "4", "--no-progress",
                 *small]) == 0
    code, said = torchrun(4, ["graphs/tiny_dp.toml", "--steps", "2", "--out", str(online), *small])
    assert code == 0, said
    cmd = [sys.executable, "-m", "dflash_graph", "launch", "--standalone", "--nproc-per-node", "2", "run",
           "graphs/tiny_dp.toml", "--hidden-states", str(cache), "--steps", "2", "--out", str(disk), "--no-progress",
           *small]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        said, _ = p.communicate(timeout=300)
    finally:
        for c in _descendants(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, 9)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
        p.wait()
    assert p.returncode == 0, said
    assert session_gone(p.pid)
    assert "launch (this run): 2 rank(s), the drafter side alone" in said
    assert "held-out @" not in said          # no target to evaluate with after the launch
    a, b = read_metrics(online), read_metrics(disk)
    assert [r["step"] for r in b] == [1, 2]
    keys = ("loss", "grad_norm", "slot_acc", "tau", "slot_accept", "lr")
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, ra["step"]
        assert set(rb["ranks"]) == {"0", "1"}
    assert json.loads((disk / "ranks" / "rank0.json").read_text())["writer"] is True
    mem = json.loads((disk / "memory.json").read_text())
    assert mem["processes"] == 2 and {d: v["rank"] for d, v in mem["devices"].items()} == {"d0": 0, "d1": 1}
    # the drafter devices hold what they hold online (the live tracker, byte for byte)
    on = json.loads((online / "memory.json").read_text())["devices"]
    assert {d: v["measured_peak_bytes"] for d, v in mem["devices"].items()} == \
        {d: on[d]["measured_peak_bytes"] for d in ("d0", "d1")}


def test_a_from_disk_launch_of_the_online_size_is_refused_with_the_drafter_sides(in_repo, tmp_path, monkeypatch,
                                                                                 capsys):
    """tiny_dp online is 4 ranks; from the cache it is its 2 drafter ranks: a launch of 4 is refused before any
    work (exit 2) naming --nproc-per-node 2 and the drafter devices' ranks; --hybrid under torchrun is refused
    with the commands to run instead."""
    from test_distributed import as_torchrun_rank

    exits = as_torchrun_rank(monkeypatch, 4, 0)
    for extra, said in (([], ["torchrun started 4 processes, but the graph's devices map to 2 rank(s) (d0=0, d1=1)",
                              "--nproc-per-node 2"]),
                        (["--hybrid"], ["--hybrid runs the target side in the run's own process",
                                        "dflash-graph launch --nproc-per-node N capture graphs/tiny_dp.toml"])):
        with pytest.raises(SystemExit):
            main(["run", "graphs/tiny_dp.toml", "--out", str(tmp_path / "run"), "--no-progress",
                  "--hidden-states", str(tmp_path / "cache"), *extra])
        err = capsys.readouterr().err
        assert all(s in err for s in said), err
    assert exits == [2, 2] and not (tmp_path / "run").exists()


def test_loader_bound_counts_every_reading_rank():
    """Under torchrun each drafter rank runs its own loader: M of them on the host."""
    one = LoaderMemory(1000, 1, 2)
    two = LoaderMemory(1000, 1, 2, readers=2)
    assert two.bytes == 2 * one.bytes == 8000 and "in each of 2 ranks" in two.text()
