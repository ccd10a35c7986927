"""The hidden-state cache (docs/offline.md): check's storage bill, capture, training from disk step for step equal
to the online run, the cache's signature, bad shards named, a capture killed and resumed."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_graph.analysis.capture import compare_signatures, file_sha256
from dflash_graph.cli.main import main

TINY = "graphs/tiny.toml"
SMALL = ["--set", "capture.shard_samples=2", "--set", "train.eval_every=0"]
TIMING = {"tokens_per_s", "step_seconds", "ranks", "memory_bytes", "slot_reach", "slot_scored"}


def metrics(d: Path) -> list[dict]:
    return [json.loads(line) for line in open(d / "metrics.jsonl")]


def test_check_capture_bill(in_repo, capsys):
    assert main(["check", TINY, "--capture", "--json", "--set", "capture.disk=10MB"]) == 0
    cap = json.loads(capsys.readouterr().out)["capture"]
    assert list(cap["bytes_per_sample"]) == ["anchored", "all", "anchored-fp8"] == list(cap["bytes_total"])
    # fp8: one byte per float element and a float32 scale per row: features [256, 256], rows [16, 4, 128]
    assert cap["storages"][2]["payload_bytes_per_sample"] == 256 * 256 + 256 * 4 + 16 * 4 * 128 + 16 * 4 * 4 \
        + 2 * 256 * 8 + 16 * 8 + 16 * 4
    payload = sum(c["bytes"] for c in cap["crossings"])
    anchored = cap["storages"][0]
    assert anchored["payload_bytes_per_sample"] == payload
    # features [256, 256] f32 + the anchored rows [16, 4, 128] f32 + ids, positions [256] i64 + anchors [16] i64
    # + valid [16, 4] bool
    assert payload == 256 * 256 * 4 + 16 * 4 * 128 * 4 + 2 * 256 * 8 + 16 * 8 + 16 * 4
    assert cap["bytes_total"]["anchored"] == cap["bytes_per_sample"]["anchored"] * cap["samples"] == \
        anchored["bytes_per_sample"] * 400
    # all rows: the whole last hidden state [256, 128] instead of its anchored rows, the loss mask instead of the draws
    assert cap["storages"][1]["payload_bytes_per_sample"] == payload - 16 * 4 * 128 * 4 + 256 * 128 * 4 \
        - 16 * 8 - 16 * 4 + 256
    assert cap["rewrites_save_bytes_per_sample"] == (256 - 64) * 128 * 4
    assert cap["disk_bytes"] == 10**7 and cap["fits"] is False
    assert anchored["read_bytes_per_second"] > 0


def test_check_capture_does_not_import_torch(in_repo, tmp_path):
    code = ("import sys; from dflash_graph.cli.main import main; "
            f"rc = main(['check', 'graphs/tiny.toml', '--capture', {str(tmp_path)!r}, '--json']); "
            "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules, 'check --capture imported torch'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_signature_differences_are_named():
    a = {"dims": {"seq": 256, "hidden": 128}, "anchors": {"seed": 0}, "storage": "anchored"}
    b = {"dims": {"seq": 512, "hidden": 128}, "anchors": {"seed": 0}}
    assert compare_signatures(a, b) == ['dims.seq: the cache has 256, the graph has 512',
                                        'storage: the cache has "anchored", the graph has "absent"']
    assert compare_signatures(a, a) == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One capture of 4 samples (2 steps of 2 replicas, shards of 2), the online run (2 steps), the run from disk
    (4 steps: the second pass reads the cache again) and the hybrid run (4 steps: epoch 0 captures)."""
    root = tmp_path_factory.mktemp("capture")
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parent.parent)
    try:
        assert main(["capture", TINY, "--out", str(root / "cache"), "--samples", "4", "--no-progress", *SMALL]) == 0
        assert main(["run", TINY, "--steps", "2", "--out", str(root / "online"), "--no-progress", *SMALL]) == 0
        assert main(["run", TINY, "--steps", "4", "--out", str(root / "disk"), "--no-progress", *SMALL,
                     "--hidden-states", str(root / "cache")]) == 0
        with contextlib.redirect_stdout(io.StringIO()) as said:
            assert main(["run", TINY, "--steps", "4", "--out", str(root / "hybrid"), "--no-progress", *SMALL,
                         "--set", "capture.samples=4", "--hidden-states", str(root / "hybrid-cache"), "--hybrid"]) == 0
        (root / "hybrid.out").write_text(said.getvalue())
    finally:
        os.chdir(cwd)
    return root


def same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_from_disk_equals_online(runs):
    online, disk = metrics(runs / "online"), metrics(runs / "disk")
    assert len(online) == 2 and len(disk) == 4
    for a, b in zip(online, disk):
        assert same(a, b)      # loss, grad norm, slot accuracies, acceptance, lr: exact
    # no target ran: only the drafter's device was measured
    assert set(json.loads((runs / "disk" / "memory.json").read_text())["devices"]) == {"draft"}


def test_hybrid_captures_epoch_zero_then_reads(runs, capsys):
    online, disk, hybrid = metrics(runs / "online"), metrics(runs / "disk"), metrics(runs / "hybrid")
    assert all(same(a, b) for a, b in zip(online, hybrid[:2]))      # epoch 0: the online run
    assert all(same(a, b) for a, b in zip(disk, hybrid))             # then the cache, as a run from disk reads it
    # 4 target forwards for 4 steps of 2 replicas: epoch 0 only
    assert "4 target forwards captured into" in (runs / "hybrid.out").read_text()
    assert "4 samples read from it" in (runs / "hybrid.out").read_text()
    # the cache it wrote is the capture's, byte for byte
    for f in sorted((runs / "cache").glob("shard-*")):
        assert file_sha256(f) == file_sha256(runs / "hybrid-cache" / f.name)


def test_predicted_bytes_equal_written(runs, in_repo, capsys):
    assert main(["check", TINY, "--capture", "--json", "--set", "capture.samples=4", *SMALL]) == 0
    predicted = json.loads(capsys.readouterr().out)["capture"]["bytes_total"]["anchored"]
    written = sum(p.stat().st_size for p in (runs / "cache").glob("shard-*.safetensors"))
    assert abs(written - predicted) / written < 0.01, (predicted, written)


def test_other_graph_refused_naming_differences(runs, in_repo, capsys):
    assert main(["run", TINY, "--steps", "1", "--out", str(runs / "x"), "--no-progress", *SMALL,
                 "--set", "train.seed=1", "--set", "dims.anchors=8", "--hidden-states", str(runs / "cache")]) == 2
    err = capsys.readouterr().err
    assert "captured from another graph" in err
    assert "anchors.seed: the cache has 0, the graph has 1" in err
    assert "dims.anchors: the cache has 16, the graph has 8" in err
    assert "crossings.anchors_tx.shape" in err


@pytest.mark.slow
def test_tampered_and_missing_shards(runs, in_repo, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(runs / "cache", cache)
    shard = cache / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    args = ["run", TINY, "--steps", "2", "--no-progress", *SMALL, "--hidden-states", str(cache)]
    assert main([*args, "--out", str(tmp_path / "stop")]) == 2
    err = capsys.readouterr().err
    assert "shard-000001.safetensors" in err and "sha256" in err and "samples 2..3" in err
    # skip: the bad shard's samples are counted and the run trains on the others
    assert main([*args, "--out", str(tmp_path / "skip"), "--on-bad-shard", "skip", "--loader-workers", "0"]) == 0
    assert "skipped 2 samples" in capsys.readouterr().err
    # capture again: only the bad shard is written again, and the cache equals the one before
    assert main(["capture", TINY, "--out", str(cache), "--samples", "4", "--no-progress", *SMALL]) == 0
    out = capsys.readouterr()
    assert "1 kept from before" in out.out and "shard-000001.safetensors: sha256" in out.err
    assert file_sha256(shard) == file_sha256(runs / "cache" / shard.name)
    shard.unlink()
    assert main([*args, "--out", str(tmp_path / "missing")]) == 2
    assert "shard-000001.safetensors: cannot be read" in capsys.readouterr().err


@pytest.mark.slow
def test_capture_killed_then_resumed(runs, in_repo, tmp_path):
    """SIGKILL while shards are being written, then capture again: every shard complete, verified against the
    manifest, and byte for byte the uninterrupted capture's."""
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "dflash_graph", "capture", TINY, "--out", str(out), "--samples", "8",
           "--set", "capture.shard_samples=1", "--set", "train.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = out / "manifest.json"
            if m.exists() and len(json.loads(m.read_text())["shards"]) >= 2:
                break
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    kept = len(json.loads((out / "manifest.json").read_text())["shards"])
    assert 2 <= kept < 8, "the kill came after the capture finished"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{kept} kept from before" in r.stdout or f"{kept + 1} kept from before" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["index"] for e in manifest["shards"]] == list(range(8))
    for e in manifest["shards"]:
        assert file_sha256(out / e["file"]) == e["sha256"]
    assert not list(out.glob(".*tmp*"))
    # the same tensors as the online run received: compared through the run from disk
    ref = subprocess.run([sys.executable, "-m", "dflash_graph", "run", TINY, "--steps", "2", "--no-progress",
                          "--set", "train.eval_every=0", "--set", "capture.shard_samples=1", "--out",
                          str(tmp_path / "run"), "--hidden-states", str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(runs / "online")]


def test_target_heads_alone_equal_the_full_build(in_repo):
    """A run from disk builds only the target's embedding, final norm and lm_head (NOTE [Heads only]): the same
    tensors as the whole model's, and no body."""
    import torch

    from dflash_graph.models.nn.target import build_target, build_target_heads, embedding, final_norm, lm_head

    full = build_target("graphs/tiny/config.json", "graphs/tiny/model.safetensors", torch.float32, "cpu")
    heads = build_target_heads("graphs/tiny/config.json", "graphs/tiny/model.safetensors", torch.float32, "cpu")
    for pick in (embedding, final_norm, lm_head):
        assert torch.equal(pick(full).weight, pick(heads).weight)
    assert all(p.is_meta for p in heads.model.layers.parameters())


def test_capture_refused_when_it_does_not_fit(in_repo, tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["capture", TINY, "--out", str(out), "--set", "capture.disk=1MB", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the cache would not fit: 400 samples x 292.73 KiB = 114.35 MiB" in err and "[capture] disk" in err
    assert not out.exists()      # refused before anything was written or built


@pytest.mark.slow
def test_resume_from_disk_continues_exactly(runs, in_repo, tmp_path):
    out = tmp_path / "run"
    args = ["run", TINY, "--no-progress", *SMALL, "--set", "train.checkpoint_every=1", "--hidden-states",
            str(runs / "cache"), "--out", str(out)]
    assert main([*args, "--steps", "1"]) == 0
    assert main([*args, "--steps", "4", "--resume", str(out)]) == 0
    assert all(same(a, b) for a, b in zip(metrics(runs / "disk"), metrics(out)))
    assert len(metrics(out)) == 4


def test_fp8_storage(runs, in_repo, tmp_path, capsys):
    """[capture] dtype = "fp8": float8_e4m3fn with a scale per row; the bytes as predicted, each value within
    fp8's rounding (3 mantissa bits: half a step is 1/16 of the value, or 2**-10 of the row's amax near 0)."""
    import torch
    from safetensors.torch import load_file

    from dflash_graph.train.hidden_cache import dequantize

    fp8 = ["--set", "capture.dtype=fp8", "--set", "capture.samples=2", "--set", "capture.shard_samples=2"]
    assert main(["check", TINY, "--capture", "--json", *fp8]) == 0
    cap = json.loads(capsys.readouterr().out)["capture"]
    assert list(cap["bytes_total"])[0] == "anchored-fp8"        # the default: what capture writes
    assert main(["capture", TINY, "--out", str(tmp_path / "c"), "--no-progress", *fp8]) == 0
    written = (tmp_path / "c" / "shard-000000.safetensors").stat().st_size
    assert abs(written - cap["bytes_total"]["anchored-fp8"]) / written < 0.01
    q, ref = load_file(str(tmp_path / "c" / "shard-000000.safetensors")), load_file(str(runs / "cache" / "shard-000000.safetensors"))
    for key in ("000000000000/features_tx", "000000000001/last_hidden_tx"):
        x = ref[key]
        y = dequantize(q[key], q[key + "#scale"], torch.float32)
        amax = x.abs().amax(-1, keepdim=True)
        assert ((y - x).abs() <= x.abs() / 16 + amax * 2.0**-10).all()
    assert torch.equal(q["000000000000/ids_tx"], ref["000000000000/ids_tx"])     # integers as they are


def test_all_rows_storage_redraws_anchors(runs, in_repo, tmp_path, capsys):
    """[capture] storage = "all": the whole last hidden state and the loss mask are stored, the anchors drawn again
    when read: the first pass is the online run, the second draws other anchors than the anchored cache repeats."""
    sets = [*SMALL, "--set", "capture.storage=all", "--set", "capture.samples=4"]
    assert main(["check", TINY, "--capture", "--json", *sets]) == 0
    predicted = json.loads(capsys.readouterr().out)["capture"]["bytes_total"]["all"]
    assert main(["capture", TINY, "--out", str(tmp_path / "c"), "--no-progress", *sets]) == 0
    written = sum(p.stat().st_size for p in (tmp_path / "c").glob("shard-*.safetensors"))
    assert abs(written - predicted) / written < 0.01
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "r"), "--no-progress", *sets,
                 "--hidden-states", str(tmp_path / "c")]) == 0
    got, online, anchored = metrics(tmp_path / "r"), metrics(runs / "online"), metrics(runs / "disk")
    assert all(same(a, b) for a, b in zip(online, got[:2]))
    assert got[2]["loss"] != anchored[2]["loss"] and got[3]["loss"] != anchored[3]["loss"]


@pytest.mark.slow
def test_hybrid_all_rows_equals_from_disk(in_repo, tmp_path):
    """--hybrid with the 'all' storage: epoch 0 captures, epoch 1 reads and draws the anchors a run from the same
    cache draws for those steps."""
    sets = [*SMALL, "--set", "capture.storage=all", "--set", "capture.samples=4"]
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "h"), "--no-progress", *sets,
                 "--hidden-states", str(tmp_path / "c"), "--hybrid"]) == 0
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "d"), "--no-progress", *sets,
                 "--hidden-states", str(tmp_path / "c")]) == 0
    assert all(same(a, b) for a, b in zip(metrics(tmp_path / "h"), metrics(tmp_path / "d")))


def test_manifest_merge_of_target_ranks(tmp_path):
    """NOTE [One writer per target rank]: each rank's shards hold every R-th sample; the merged manifest orders
    them by first sample, names the shard of a sample, and is refused unless every sample is held exactly once."""
    from dflash_graph.analysis.capture import entry_samples, merge_parts, missing_samples, samples_text, shard_of
    from dflash_graph.errors import GraphError

    def part(rank, q, n):          # rank's shards of 2 samples, replica q of 2, n samples in all
        mine = range(q, n, 2)
        return [{"index": k, "file": f"shard-r{rank}-{k:05d}.safetensors", "first": mine[2 * k],
                 "samples": len(mine[2 * k:2 * k + 2]), "stride": 2, "rank": rank} for k in range(-(-len(mine) // 2))]

    m = merge_parts({"dims": {}}, 7, 2, [0, 1], {0: part(0, 0, 7), 1: part(1, 1, 7)})
    assert [e["file"] for e in m["shards"]] == ["shard-r0-00000.safetensors", "shard-r1-00000.safetensors",
                                                "shard-r0-00001.safetensors", "shard-r1-00001.safetensors"]
    assert [list(entry_samples(e)) for e in m["shards"]] == [[0, 2], [1, 3], [4, 6], [5]]
    assert m["replica_ranks"] == [0, 1] and missing_samples(m) == []
    assert samples_text(m["shards"][2]) == "samples 4..6, every 2th"
    assert [shard_of(m, i) for i in (5, 6)] == ["shard-r1-00001.safetensors", "shard-r0-00001.safetensors"]
    assert list(entry_samples({"first": 4, "samples": 2})) == [4, 5]      # one process: consecutive samples
    with pytest.raises(GraphError, match="hold 4 of 7 samples"):
        merge_parts({}, 7, 2, [0, 1], {0: part(0, 0, 7)})
    with pytest.raises(GraphError, match="sample 0 is in two shards"):
        merge_parts({}, 7, 2, [0, 1], {0: part(0, 0, 7), 1: part(0, 0, 7) + part(1, 1, 7)})


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its ranks in sessions of their own)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


@pytest.mark.slow
def test_capture_under_launch_one_writer_per_target_rank(runs, in_repo, tmp_path):
    """`launch --nproc-per-node 3 capture` on tiny (t0, t1: target ranks 0 and 1; the drafter's rank 2 writes
    nothing): rank 1 is killed after its first shard, the other ranks stop naming it (the heartbeats of
    exec/distributed.py watch the capture and its final gather), the launch is run again and resumes each rank's finished
    shards; the merged manifest verifies, every tensor is the one-process capture's, and a run from the cache in one
    process gives the online run's losses, step for step."""
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "dflash_graph", "launch", "--standalone", "--nproc-per-node", "3", "capture", TINY,
           "--out", str(out), "--samples", "12", "--set", "capture.shard_samples=1", "--set", "train.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        part = out / "manifest-r1.json"
        deadline = time.monotonic() + 240
        while not (part.exists() and json.loads(part.read_text())["shards"]):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "rank 1 never wrote a shard"
            time.sleep(0.02)
        victim = next(c for c in _descendants(p.pid) if _rank_of(c) == 1)
        os.kill(victim, signal.SIGKILL)
        said, _ = p.communicate(timeout=120)
    finally:
        for c in _descendants(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode != 0, said
    # the ranks that wait (the drafter's, in the final gather) and capture (rank 0) stop on the heartbeats, naming it
    assert said.count("lost rank 1 (t1; pid") >= 2 and "killed (SIGKILL" in said, said
    assert not (out / "manifest.json").exists()         # written once, by the writer rank, when every rank is done
    kept1 = len(json.loads(part.read_text())["shards"])
    assert 1 <= kept1 < 6, "the kill came after rank 1 finished"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "captured 12 samples" in r.stdout and "by target ranks 0, 1: 12 shards" in r.stdout
    assert "kept from before" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["replica_ranks"] == [0, 1]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", *sorted(e["file"] for e in manifest["shards"])]
    assert {e["file"] for e in manifest["shards"]} == {f"shard-r{r}-{k:05d}.safetensors" for r in (0, 1)
                                                       for k in range(6)}
    for e in manifest["shards"]:
        assert file_sha256(out / e["file"]) == e["sha256"]
    # every tensor as the one-process capture wrote it (its samples 0..3)
    from safetensors.torch import load_file
    import torch

    mine, ref = {}, {}
    for e in manifest["shards"]:
        mine.update(load_file(str(out / e["file"])))
    for f in (runs / "cache").glob("shard-*.safetensors"):
        ref.update(load_file(str(f)))
    assert ref and all(torch.equal(mine[k], v) for k, v in ref.items())
    # a run from the cache in one process: the online run's losses, step for step
    assert main(["run", TINY, "--steps", "2", "--out", str(tmp_path / "run"), "--no-progress", "--set",
                 "train.eval_every=0", "--set", "capture.shard_samples=1", "--hidden-states", str(out)]) == 0
    assert all(same(a, b) for a, b in zip(metrics(runs / "online"), metrics(tmp_path / "run")))
    assert len(metrics(tmp_path / "run")) == 2


def test_anchor_draws_equal_online_for_k_passes(in_repo, tmp_path, capsys):
    """[capture] anchor_draws = 2 (NOTE [Anchor draws]): pass p over the cache reads draw p mod 2, and draw e of
    sample i is the online run's draw for training sample e * N + i. On a corpus of one document (longer than
    seq) every packed sequence holds the same tokens, so the online run's epoch 1 is sample i's data again with
    the anchors of training sample N + i: 4 steps from a 4-sample cache equal 4 online steps, step for step. Bytes
    as predicted within 1%; the JSON bill carries K; a cache of another K is refused, naming it; pass 2 reads
    draw 0 again."""
    import torch

    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.hidden_cache import CacheSource

    corpus = tmp_path / "one.jsonl"
    corpus.write_text(open("graphs/tiny/corpus.jsonl").readline())      # 349 tokens: every sample is its first 256
    one = [*SMALL, "--set", f"data.corpus={corpus}", "--set", "data.holdout=0", "--set", "capture.samples=4"]
    sets = [*one, "--set", "capture.anchor_draws=2"]
    assert main(["check", TINY, "--capture", "--json", *sets]) == 0
    cap = json.loads(capsys.readouterr().out)["capture"]
    assert cap["anchor_draws"] == 2
    more = cap["bytes_per_sample_per_more_draw"]["anchored"]
    # one more draw: the anchored rows [16, 4, 128] f32, anchors [16] i64, valid [16, 4] bool, and their header
    assert 16 * 4 * 128 * 4 + 16 * 8 + 16 * 4 < more < 16 * 4 * 128 * 4 + 16 * 8 + 16 * 4 + 400
    assert main(["capture", TINY, "--out", str(tmp_path / "c"), "--no-progress", *sets]) == 0
    written = sum(p.stat().st_size for p in (tmp_path / "c").glob("shard-*.safetensors"))
    assert abs(written - cap["bytes_total"]["anchored"]) / written < 0.01, (written, cap["bytes_total"])
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "online"), "--no-progress", *sets]) == 0
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "disk"), "--no-progress", *sets,
                 "--hidden-states", str(tmp_path / "c")]) == 0
    online, disk = metrics(tmp_path / "online"), metrics(tmp_path / "disk")
    assert len(online) == len(disk) == 4
    assert all(same(a, b) for a, b in zip(online, disk)), [(a["loss"], b["loss"]) for a, b in zip(online, disk)]
    # the cache of 2 draws is not a cache of 1
    assert main(["run", TINY, "--steps", "1", "--out", str(tmp_path / "x"), "--no-progress", *one,
                 "--hidden-states", str(tmp_path / "c")]) == 2
    assert "anchors.draws: the cache has 2, the graph has 1" in capsys.readouterr().err
    # the draws differ, and pass 2 reads draw 0 again
    src = CacheSource(compile_graph(TINY, [s for s in sets if s != "--set"]), tmp_path / "c", workers=0)
    passes = [[src.next_inbox() for _ in range(4)] for _ in range(3)]
    src.close()
    assert not torch.equal(passes[0][0]["anchors_tx"], passes[1][0]["anchors_tx"])
    assert torch.equal(passes[0][0]["features_tx"], passes[1][0]["features_tx"])        # stored once
    for a, b in zip(passes[0], passes[2]):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_hybrid_with_anchor_draws_equals_online(in_repo, tmp_path):
    """--hybrid with [capture] anchor_draws = 2 on a one-document corpus: epoch 0 trains online and writes both
    draws of each sample, epoch 1 reads draw 1: 4 steps equal the online run's, and the cache is the capture's."""
    corpus = tmp_path / "one.jsonl"
    corpus.write_text(open("graphs/tiny/corpus.jsonl").readline())
    sets = [*SMALL, "--set", f"data.corpus={corpus}", "--set", "data.holdout=0", "--set", "capture.samples=4",
            "--set", "capture.anchor_draws=2"]
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "h"), "--no-progress", *sets,
                 "--hidden-states", str(tmp_path / "hc"), "--hybrid"]) == 0
    assert main(["run", TINY, "--steps", "4", "--out", str(tmp_path / "online"), "--no-progress", *sets]) == 0
    assert all(same(a, b) for a, b in zip(metrics(tmp_path / "online"), metrics(tmp_path / "h")))
    assert len(metrics(tmp_path / "h")) == 4
    assert main(["capture", TINY, "--out", str(tmp_path / "c"), "--no-progress", *sets]) == 0
    for f in sorted((tmp_path / "c").glob("shard-*")):
        assert file_sha256(f) == file_sha256(tmp_path / "hc" / f.name)
