"""Host limits: the CPU devices share the host's memory; a closed pipe ends output quietly; `run` without torch.

No test reads the real host's memory: the figure is declared (--host-memory, [memory] host_memory) or the
reading is monkeypatched.
"""

import json
import os
import subprocess
import sys

import pytest

from dflash_graph.analysis import memory
from dflash_graph.cli.main import EXIT_CLOSED_PIPE, main

GiB = 2**30
QWEN_ON_CPU = ["graphs/qwen27b.toml", "--device-map", "cuda:*=cpu"]


@pytest.fixture
def host_24gib(monkeypatch):
    """This host has 24 GiB available, whatever the machine running the tests has."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (24 * GiB, "MemAvailable"))


def check(capsys, *args):
    code = main(["check", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_cuda_graph_mapped_to_cpu_does_not_fit_the_host(in_repo, capsys, host_24gib):
    code, out, _ = check(capsys, *QWEN_ON_CPU)
    assert code == 1
    assert ("OOM on host memory: the CPU devices gpu0..gpu7 (8 devices) need 599.95 GiB together (the sum of their "
            "peaks); this host has 24.00 GiB (available: MemAvailable in /proc/meminfo)") in out
    assert "--host-memory 512GiB or [memory] host_memory" in out
    assert out.splitlines()[-2].startswith("verdict: predicted OOM on gpu0, ") and out.splitlines()[-2].endswith(
        ", host memory")
    # a device mapped to the CPU has the host's memory, not the GPU's 94.97 GiB nor its CUDA context
    row = next(ln for ln in out.splitlines() if ln.startswith("  gpu0 "))
    assert row.split()[:4] == ["gpu0", "cpu", "24.00", "GiB"]
    assert "94.97 GiB" not in out


def test_declared_host_memory_fits(in_repo, capsys, monkeypatch):
    def unread():
        raise AssertionError("a declared figure must not read the host")

    monkeypatch.setattr(memory, "host_available_bytes", unread)
    code, out, _ = check(capsys, *QWEN_ON_CPU, "--host-memory", "1TiB")
    assert code == 0, out
    assert ("host memory: the CPU devices gpu0..gpu7 (8 devices) share it and need 599.95 GiB together (the sum of "
            "their peaks); this host has 1024.00 GiB (declared: --host-memory or [memory] host_memory)") in out
    assert "verdict: fits on every device" in out
    # the same figure from the TOML key (one declaration: [memory] host_memory)
    code, out2, _ = check(capsys, *QWEN_ON_CPU, "--set", "memory.host_memory=1TiB")
    assert code == 0 and "this host has 1024.00 GiB (declared" in out2


def test_only_the_shared_pool_overflows(in_repo, capsys, host_24gib):
    # tiny: three CPU devices of 4 GiB each, about 26 MiB in all; each fits alone, not all three in 20 MiB
    code, out, _ = check(capsys, "graphs/tiny.toml", "--host-memory", "20MiB")
    assert code == 1
    assert "OOM on host memory: the CPU devices t0..draft (3 devices) need" in out
    assert "verdict: predicted OOM on host memory\n" in out
    assert "OOM on t0" not in out and "expandable" not in out   # no CUDA advice for CPU devices
    code, out, _ = check(capsys, "graphs/tiny.toml")
    assert code == 0 and "this host has 24.00 GiB (available: MemAvailable in /proc/meminfo)" in out
    # the declared capacity of a device written as a CPU is kept
    assert next(ln for ln in out.splitlines() if ln.startswith("  t0 ")).split()[2:4] == ["4.00", "GiB"]


def test_json_carries_the_host(in_repo, capsys, host_24gib):
    code, out, _ = check(capsys, *QWEN_ON_CPU, "--json")
    js = json.loads(out)
    assert code == 1 and js["fits"] is False
    assert js["host"] == {"devices": [f"gpu{i}" for i in range(8)], "need_bytes": js["host"]["need_bytes"],
                          "available_bytes": 24 * GiB, "source": "MemAvailable", "fits": False}
    assert js["host"]["need_bytes"] == sum(d["peak_bytes"] for d in js["devices"].values())
    assert js["devices"]["gpu0"]["capacity_bytes"] == 24 * GiB
    code, out, _ = check(capsys, "graphs/qwen27b.toml", "--json")   # no CPU device: no host pool
    assert json.loads(out)["host"] is None


def test_unreadable_host_is_said_and_not_a_verdict(in_repo, capsys, monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (None, "unknown"))
    code, out, _ = check(capsys, "graphs/tiny.toml")
    assert code == 0
    assert "how much this host has cannot be read (declare it: --host-memory or [memory] host_memory)" in out


@pytest.mark.parametrize("size", ["lots", "0"])
def test_bad_host_memory_names_the_flag(in_repo, capsys, size):
    code, out, err = check(capsys, "graphs/tiny.toml", "--host-memory", size)
    assert code == 2 and not out
    assert f"--host-memory {size}" in err and "e.g. --host-memory 512GiB" in err
    assert "Traceback" not in err


# -- a closed pipe ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="needs Linux's F_SETPIPE_SZ")
@pytest.mark.parametrize("cmd", [["check", "graphs/tiny.toml"], ["check", "graphs/tiny.toml", "--json"],
                                 ["check", "graphs/qwen27b.toml"], ["plan", "graphs/qwen27b.toml"]])
def test_closed_pipe_ends_quietly(in_repo, cmd):
    """`dflash-graph check G | head -1`: one line read, the pipe closed; no message, no traceback."""
    import fcntl

    r, w = os.pipe()
    # 4 KiB, smaller than each of these outputs (over 4.4 KiB): the writer blocks until...
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    env = {**os.environ, "PYTHONPATH": str(in_repo), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "dflash_graph", *cmd], stdout=w, stderr=subprocess.PIPE, env=env)
    os.close(w)
    line = b""
    while not line.endswith(b"\n"):                # ...one line is read, byte by byte, and the pipe closed
        b = os.read(r, 1)
        assert b, "the command printed nothing"
        line += b
    os.close(r)
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert err == "", err
    assert p.returncode == EXIT_CLOSED_PIPE


def test_closed_pipe_in_any_command_is_quiet(in_repo, capsys, monkeypatch):
    from dflash_graph.cli import evaluate

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(evaluate, "cmd_export", closed)
    assert main(["export", "runs/none", "--out", "x"]) == EXIT_CLOSED_PIPE
    assert capsys.readouterr().err == ""


def test_closed_pipe_under_rich_reaches_the_entry_point():
    from dflash_graph.cli.console import rich_console

    pytest.importorskip("rich")
    with pytest.raises(BrokenPipeError):
        rich_console().on_broken_pipe()


# -- run in a check-only install -----------------------------------------------------------------------------------

def test_run_without_torch_is_usage_error_with_hint(in_repo, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # `import torch` raises ImportError, as when not installed
    assert main(["run", "graphs/tiny.toml", "--steps", "1", "--out", "/nonexistent/never"]) == 2
    got = capsys.readouterr()
    assert "`run` needs torch, which is not installed (check works without it)" in got.err
    assert 'pip install torch && pip install -e ".[run]"' in got.err
    assert "Traceback" not in got.err


def test_max_counts_the_host(in_repo, host_24gib):
    """check --max: the largest seq at which the CPU devices fit the host together, confirmed by check itself."""
    from dflash_graph.cli.whatif import max_for_graph, render_max
    from dflash_graph.rewrite.pipeline import compile_graph

    r = max_for_graph("graphs/tiny.toml", ["memory.host_memory=64MiB"], "dims.seq")
    assert r.value is not None and r.confirmed and r.next_oom is None
    assert r.next_host is not None and r.next_host.need_bytes > 64 * 2**20
    assert f"at seq={r.value + 1:,}: OOM on host memory: the CPU devices need" in render_max(r)
    assert r.to_json()["next"]["host"]["available_bytes"] == 64 * 2**20

    def at(v):
        return compile_graph("graphs/tiny.toml", ["memory.host_memory=64MiB", f"dims.seq={v}"]).memory

    assert at(r.value).fits and not at(r.value + 1).fits and at(r.value + 1).ooms == []


def test_resume_accepts_other_memory_figures(in_repo, tmp_path):
    """A CPU-mapped device's capacity is this host's available memory, which differs between invocations: a resume
    does not call that a changed graph (a changed dim still is)."""
    from dflash_graph.errors import GraphError
    from dflash_graph.spec.loader import load_graph
    from dflash_graph.train import rundir

    old = load_graph("graphs/qwen27b.toml", ["devices.gpu0.torch=cpu", "devices.gpu0.capacity=20GiB",
                                             "devices.gpu0.outside_allocator=0"])
    rundir.record(tmp_path, old, ["dflash-graph", "run"], [], steps=int(old.train["steps"]))
    new = load_graph("graphs/qwen27b.toml", ["devices.gpu0.torch=cpu", "devices.gpu0.capacity=21GiB",
                                             "devices.gpu0.outside_allocator=0", "memory.host_memory=1TiB"])
    rundir.check_resume(tmp_path, new, [])
    with pytest.raises(GraphError, match="dims.seq"):
        rundir.check_resume(tmp_path, load_graph("graphs/qwen27b.toml", ["devices.gpu0.torch=cpu",
                                                                          "dims.seq=4096"]), [])


def test_run_does_not_record_the_host_figure_as_a_set_flag(in_repo, tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "r"
    assert main(["run", "graphs/tiny.toml", "--no-progress", "--steps", "1", "--out", str(out),
                 "--host-memory", "20MiB"]) == 1           # the three CPU devices need about 26 MiB together
    got = capsys.readouterr()
    assert "OOM on host memory: the CPU devices t0..draft (3 devices) need" in got.err
    assert "refusing to run: check predicts an OOM" in got.err
    assert "host memory: the CPU devices t0..draft (3 devices) share it" in got.out
