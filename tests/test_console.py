"""The console: one OOM block per distinct failure naming the tensor, did-you-mean for flags, plan --emit never
overwriting its input, check --device-map, rich on a terminal and plain lines elsewhere, smoothed progress."""

import io
import json
import re

import pytest

from dflash_graph.cli.main import main
from dflash_graph.train.metrics import RunStats, Smoothed, acceptance_length
from dflash_graph.train.progress import Progress


def test_one_oom_block_per_distinct_failure(in_repo, capsys):
    assert main(["check", "graphs/qwen27b.toml", "--set", "dims.seq=140000"]) == 1
    out = capsys.readouterr().out
    blocks = [ln for ln in out.splitlines() if ln.startswith("OOM on")]
    assert blocks == ["OOM on gpu0..gpu6 (7 devices) at node 'target':", "OOM on gpu7 at node 'drafter':"]
    assert not re.search(r"#\d+", out), "an internal replay key leaked into the message"
    # packed with a mask (graphs/qwen27b.toml declares how its authors ran the forward): the [seq, seq] mask is the
    # first temporary that does not fit, named by the op that makes it (transformers' mask code ands two masks),
    # its shape and dtype
    assert ("a 18.25 GiB temporary (aten.bitwise_and.Tensor [1, 1, 140,000, 140,000] bool in model) of the "
            "prologue inside 'target'") in out


def test_oom_names_the_output_by_shape(in_repo, capsys):
    main(["check", "graphs/qwen27b.toml", "--no-rewrite"])
    assert "allocating verifier_roll.out [65,536, 248,320] bfloat16." in capsys.readouterr().out


def test_unknown_flag_gets_did_you_mean_and_usage(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--jsn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dflash-graph check")
    assert "unrecognized argument --jsn (did you mean --json?)" in err
    assert main(["run", "graphs/tiny.toml", "--no-progess"]) == 2
    assert "did you mean --no-progress?" in capsys.readouterr().err


def test_plan_emit_never_overwrites_its_input(in_repo, tmp_path, capsys):
    src = tmp_path / "g.toml"
    src.write_text((in_repo / "graphs/tiny.toml").read_text().replace('"tiny/', f'"{in_repo}/graphs/tiny/'))
    before = src.read_text()
    assert main(["plan", str(src), "--emit", str(tmp_path / "." / "g.toml")]) == 2
    assert "plan never overwrites its input" in capsys.readouterr().err
    assert src.read_text() == before


def test_check_device_map(in_repo, capsys):
    # the eight CPU devices share the host: on a host declared with 1 TiB they fit (594 GiB together); on a smaller
    # host they do not (tests/test_host_limits.py)
    assert main(["check", "graphs/qwen27b.toml", "--device-map", "cuda:*=cpu", "--host-memory", "1TiB",
                 "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert all(d["torch"] == "cpu" and d["reserved_peak_bytes"] == d["peak_bytes"] for d in js["devices"].values())
    assert all(d["capacity_bytes"] == 2**40 for d in js["devices"].values())
    assert js["host"]["fits"] and js["host"]["available_bytes"] == 2**40


def test_no_color_and_pipes_are_plain(in_repo, capsys, monkeypatch):
    from dflash_graph.cli.console import use_rich

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert use_rich(Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_rich(Tty()) and not use_rich(io.StringIO())


def test_acceptance_length_and_smoothing():
    assert acceptance_length([0.0, 1, 1, 1]) == 4.0
    assert acceptance_length([0.3, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    e = Smoothed()
    assert e.add(7.0) == pytest.approx(7.0)             # bias-corrected: the first value is not pulled to 0
    assert 0 < e.add(0.0) < 7.0


def test_progress_plain_lines_show_smoothed_values(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = io.StringIO()
    stats = RunStats()
    p = Progress(total=4, stats=stats, bar=True, log_every=2, stream=out)   # not a terminal: plain lines
    for i, loss in enumerate([10.0, 0.0, 0.0, 0.0], 1):
        rec = {"step": i, "loss": loss, "slot_acc": [0, 1.0, 0.5], "tokens_per_s": 100.0}
        stats.update(rec)
        p.update(rec)
    p.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    smoothed = float(re.search(r"loss ([0-9.]+)", lines[0]).group(1))
    assert 4 < smoothed < 6                              # (0.9*0.1*10 + 0.1*0) / (1 - 0.81) = 4.74, not 0
    assert "tau 2.50" in lines[-1]


def test_progress_rich_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    stats = RunStats()
    p = Progress(total=2, stats=stats, bar=True, stream=out)
    assert p._bar is not None
    for i in (1, 2):
        rec = {"step": i, "loss": 1.0, "slot_acc": [0, 1.0], "tokens_per_s": 10.0}
        stats.update(rec)
        p.update(rec)
    p.close()
    text = out.getvalue()
    assert "tau 2.00" in text and "2/2" in text and "#" not in text


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    stats = RunStats()
    p = Progress(total=1, stats=stats, bar=False, stream=io.StringIO(), tensorboard=str(tmp_path / "tb"))
    rec = {"step": 1, "loss": 1.0, "slot_acc": [0, 0.5], "lr": 1e-3}
    stats.update(rec)
    p.update(rec)
    p.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_check_imports_no_plotting_or_console_libraries_unasked(in_repo):
    import subprocess
    import sys

    code = ("import sys; from dflash_graph.cli.main import main; main(['check', 'graphs/tiny.toml', '--max', "
            "'dims.anchors']); bad = [m for m in ('torch', 'matplotlib', 'rich') if m in sys.modules]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
