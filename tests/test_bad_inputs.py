"""A new user's bad inputs, one per row: missing, corrupt, truncated, empty, binary and unreadable files; wrong
types and contradictory dims through --set; bad flags; directories where files are expected. Each is exit 2
(never 3, "this is a bug"), with no traceback, and its message names the file, the flag or the TOML path the user
has to change, and says what to try. Called in one process (cli.main.main), nothing trains: every one of these is
refused before the first step.

tests/test_bad_graphs.py holds the broken graph files themselves (golden messages); this file holds what goes
wrong around them: the command line, the data, the checkpoints, the outputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_graph.cli.main import main

G = "graphs/tiny.toml"
SMALL = ["--set", "train.eval_every=0"]    # nothing in these rows gets as far as evaluating


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Every bad file the rows below name, made once."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_text("")
    (d / "binary.jsonl").write_bytes(bytes(range(256)) * 8)
    (d / "invalid.jsonl").write_text('{"text": "a fine first record"}\n{"text": "no closing brace"\n')
    (d / "wrong_type.jsonl").write_text('{"text": 42}\n')
    (d / "no_fields.jsonl").write_text('{"title": "what kind of record is this"}\n')
    (d / "adir").mkdir()
    (d / "afile").write_text("not a directory\n")
    (d / "tokenizer.json").write_text("{ this is not a tokenizer")
    (d / "config.json").write_text("{ not json")
    (d / "weights.safetensors").write_bytes(b"\x00" * 64)
    # a run directory whose checkpoint was modified after the save: the manifest's size no longer matches
    run = d / "run"
    step = run / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"graph": str(Path(G).resolve()), "overrides": []}))
    (step / "drafter.safetensors").write_bytes(b"\x00" * 16)
    (step / "trainer.pt").write_bytes(b"")
    (step / "state.json").write_text('{"step": 2}')
    files = {f: {"bytes": 1000, "sha256": "0" * 64} for f in ("drafter.safetensors", "trainer.pt", "state.json")}
    (step / "manifest.json").write_text(json.dumps({"format": "dflash-graph checkpoint 2", "step": 2, "files": files}))
    os.symlink("checkpoints/step-00000002", run / "checkpoint")
    # a checkpoint of the older layout (no manifest to catch it) whose weights are not a safetensors file
    old = d / "oldrun"
    (old / "checkpoint").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"graph": str(Path(G).resolve()), "overrides": []}))
    (old / "checkpoint" / "drafter.safetensors").write_bytes(b"{not safetensors")
    (old / "checkpoint" / "state.json").write_text('{"step": 2}')
    (old / "checkpoint" / "trainer.pt").write_bytes(b"")
    # a run directory whose run.json is not JSON, and one with only metrics (no checkpoint)
    (d / "badjson").mkdir()
    (d / "badjson" / "run.json").write_text("{ not json")
    (d / "nockpt").mkdir()
    (d / "nockpt" / "run.json").write_text(json.dumps({"graph": str(Path(G).resolve()), "overrides": []}))
    (d / "nockpt" / "metrics.jsonl").write_text("")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# (id, argv with {bad} for the fixture's directory, what the message must name)
CASES = [
    # -- check: --set values of the wrong type, and dims that contradict each other
    ("seq-zero", ["check", G, "--set", "dims.seq=0"], "dims.seq"),
    ("seq-negative", ["check", G, "--set", "dims.seq=-8"], "dims.seq"),
    ("seq-not-a-number", ["check", G, "--set", "dims.seq=abc"], "dims.seq"),
    ("block-zero", ["check", G, "--set", "dims.block=0"], "dims.block"),
    ("anchors-zero", ["check", G, "--set", "dims.anchors=0"], "dims.anchors"),
    ("seq-below-block", ["check", G, "--set", "dims.seq=2"], "dims.seq"),
    ("drafter-heads-zero", ["check", G, "--set", "models.drafter.config.num_attention_heads=0"], "num_attention_heads"),
    ("kv-heads-do-not-divide", ["check", G, "--set", "models.drafter.config.num_key_value_heads=3"],
     "num_key_value_heads"),
    ("drafter-layers-zero", ["check", G, "--set", "models.drafter.config.num_hidden_layers=0"], "num_hidden_layers"),
    ("head-dim-negative", ["check", G, "--set", "models.drafter.config.head_dim=-32"], "head_dim"),
    ("intermediate-zero", ["check", G, "--set", "models.drafter.config.intermediate_size=0"], "intermediate_size"),
    ("target-layer-ids-a-list", ["check", G, "--set", "models.drafter.config.target_layer_ids=[1, 99]"],
     "target_layer_ids"),
    ("mask-token-over-vocab", ["check", G, "--set", "models.drafter.config.mask_token_id=100000"], "mask_token_id"),
    ("lr-not-a-number", ["check", G, "--set", "train.lr=fast"], "train.lr"),
    ("steps-fraction", ["check", G, "--set", "train.steps=1.5"], "train.steps"),
    ("set-without-equals", ["check", G, "--set", "dims.seq"], "--set"),
    ("capacity-negative", ["check", G, "--set", "devices.t0.capacity=-1GiB"], "devices.t0.capacity"),
    ("target-config-not-json", ["check", G, "--set", "models.target.config={bad}/config.json"], "config.json"),
    ("target-config-missing", ["check", G, "--set", "models.target.config={bad}/nope.json"], "nope.json"),
    ("target-config-a-directory", ["check", G, "--set", "models.target.config={bad}/adir"], "adir"),
    # -- check: flags
    ("host-memory-not-a-size", ["check", G, "--host-memory", "lots"], "--host-memory"),
    ("host-memory-zero", ["check", G, "--host-memory", "0"], "--host-memory"),
    ("max-unknown-dim", ["check", G, "--max", "dims.nope"], "--max"),
    ("device-map-no-equals", ["check", G, "--device-map", "cuda"], "--device-map"),
    ("device-map-to-nothing", ["check", G, "--device-map", "cpu=gpu"], "--device-map"),
    ("without-unknown-rule", ["check", G, "--without-rule", "fuse_everything"], "--without-rule"),
    ("plot-unknown-suffix", ["check", G, "--plot", "memory.txt"], "--plot"),
    ("plot-into-missing-dir", ["check", G, "--plot", "{bad}/nodir/memory.png"], "--plot"),
    ("plot-onto-a-directory", ["check", G, "--plot", "{bad}/adir"], "--plot"),
    ("snapshot-into-missing-dir", ["check", G, "--memory-snapshot", "{bad}/nodir/s.pickle"], "--memory-snapshot"),
    ("unknown-flag", ["check", G, "--jsno"], "--jsno"),
    ("graph-is-a-directory", ["check", "graphs"], "graphs"),
    ("graph-missing", ["check", "graphs/nope.toml"], "graphs/nope.toml"),
    ("graph-is-json", ["check", "{bad}/config.json"], "config.json"),
    # -- explain, draw, plan
    ("explain-unknown-node", ["explain", G, "no_such_node"], "no_such_node"),
    ("draw-unknown-suffix", ["draw", G, "-o", "graph.txt"], "-o"),
    ("draw-into-missing-dir", ["draw", G, "-o", "{bad}/nodir/graph.dot"], "-o"),
    ("draw-onto-a-directory", ["draw", G, "-o", "{bad}/adir"], "-o"),
    ("emit-into-missing-dir", ["plan", G, "--emit", "{bad}/nodir/out.toml"], "--emit"),
    ("emit-over-the-graph", ["plan", G, "--emit", G], "--emit"),
    # -- run: flags and directories (refused before anything trains)
    ("steps-zero", ["run", G, "--steps", "0"], "--steps"),
    ("steps-not-a-number", ["run", G, "--steps", "many"], "--steps"),
    ("resume-missing", ["run", G, "--resume", "{bad}/nope"], "--resume {bad}/nope: error: no such directory"),
    ("resume-a-file", ["run", G, "--resume", "{bad}/afile"], "--resume"),
    ("resume-an-empty-directory", ["run", G, "--resume", "{bad}/adir"], "--resume {bad}/adir: error"),
    ("resume-run-json-not-json", ["run", G, "--resume", "{bad}/badjson", "--out", "{bad}/o1"], "run.json"),
    ("out-is-a-file", ["run", G, "--out", "{bad}/afile"], "--out"),
    ("allow-change-without-resume", ["run", G, "--allow-change", "train.lr", "--out", "{bad}/o2"], "--allow-change"),
    ("run-device-map-bad-index", ["run", G, "--device-map", "cpu=cuda:abc", "--out", "{bad}/o3"], "cuda:abc"),
    # -- run: data that cannot be read (the graph's [data], through --set)
    ("corpus-missing", ["run", G, "--out", "{bad}/o4", "--set", "data.corpus={bad}/nope.jsonl"], "data.corpus"),
    ("corpus-empty", ["run", G, "--out", "{bad}/o5", "--set", "data.corpus={bad}/empty.jsonl"], "empty.jsonl"),
    ("corpus-binary", ["run", G, "--out", "{bad}/o6", "--set", "data.corpus={bad}/binary.jsonl"], "binary.jsonl"),
    ("corpus-invalid-jsonl", ["run", G, "--out", "{bad}/o7", "--set", "data.corpus={bad}/invalid.jsonl"],
     "invalid.jsonl:2"),
    ("corpus-text-not-a-string", ["run", G, "--out", "{bad}/o8", "--set", "data.corpus={bad}/wrong_type.jsonl"],
     "wrong_type.jsonl"),
    ("corpus-record-kind-unknown", ["run", G, "--out", "{bad}/o9", "--set", "data.corpus={bad}/no_fields.jsonl"],
     "no_fields.jsonl"),
    ("corpus-a-directory", ["run", G, "--out", "{bad}/o10", "--set", "data.corpus={bad}/adir", "--set",
                            "data.format=text"], "adir"),
    ("tokenizer-missing", ["run", G, "--out", "{bad}/o11", "--set", "data.tokenizer={bad}/nope.json"],
     "data.tokenizer"),
    ("tokenizer-corrupt", ["run", G, "--out", "{bad}/o12", "--set", "data.tokenizer={bad}/tokenizer.json"],
     "tokenizer.json"),
    ("holdout-negative", ["run", G, "--out", "{bad}/o13", "--set", "data.holdout=-1"], "data.holdout"),
    ("holdout-everything", ["run", G, "--out", "{bad}/o14", "--set", "data.holdout=100000"], "data.holdout"),
    ("data-format-unknown", ["run", G, "--out", "{bad}/o15", "--set", "data.format=xml"], "data.format"),
    ("target-weights-missing", ["run", G, "--out", "{bad}/o16", "--set", "models.target.weights={bad}/nope"],
     "models.target.weights"),
    ("target-weights-corrupt", ["run", G, "--out", "{bad}/o17", "--set",
                                "models.target.weights={bad}/weights.safetensors"], "weights.safetensors"),
    # -- eval and export: checkpoints and devices
    ("eval-checkpoint-missing", ["eval", G, "--checkpoint", "{bad}/nope"], "--checkpoint"),
    ("eval-checkpoint-modified", ["eval", G, "--checkpoint", "{bad}/run"], "step-00000002"),
    ("eval-checkpoint-corrupt-older-layout", ["eval", G, "--checkpoint", "{bad}/oldrun"], "drafter.safetensors"),
    ("eval-checkpoint-none-saved", ["eval", G, "--checkpoint", "{bad}/nockpt"], "--checkpoint"),
    ("eval-device-cuda-here", ["eval", G, "--checkpoint", "{bad}/run", "--device", "cuda:7"], "--device"),
    ("eval-device-not-a-device", ["eval", G, "--checkpoint", "{bad}/run", "--device", "gpu"], "--device"),
    ("eval-prompts-zero", ["eval", G, "--checkpoint", "{bad}/run", "--prompts", "0"], "--prompts"),
    ("export-dir-missing", ["export", "{bad}/nope", "--out", "{bad}/hf"], "export DIR {bad}/nope: error: no such directory"),
    ("export-dir-a-file", ["export", "{bad}/afile", "--out", "{bad}/hf"], "{bad}/afile"),
    ("export-checkpoint-modified", ["export", "{bad}/run", "--out", "{bad}/hf"], "step-00000002"),
    ("export-checkpoint-corrupt-older-layout", ["export", "{bad}/oldrun", "--out", "{bad}/hf"], "drafter.safetensors"),
    ("export-run-json-not-json", ["export", "{bad}/badjson", "--out", "{bad}/hf"], "--graph"),
    ("export-dtype-unknown", ["export", "{bad}/run", "--out", "{bad}/hf", "--dtype", "int8"], "--dtype"),
]


@pytest.mark.parametrize("argv,names", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_exit_2_with_where_and_a_fix(argv, names, bad, in_repo, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_GRAPH_DEBUG", raising=False)
    argv = [a.replace("{bad}", str(bad)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:     # argparse's own refusals (a wrong type for a typed flag, a choice not offered)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err and "<graph>" not in err, err
    assert names.replace("{bad}", str(bad)) in err, err
    # what to try: a hint, the valid values, or (argparse) the usage
    assert any(w in err for w in ("hint:", "usage:", "expected", "one of", "did you mean")), err


def test_enough_bad_inputs():
    assert len(CASES) >= 50
    assert len({i for i, _, _ in CASES}) == len(CASES)


# -- messages ---------------------------------------------------------------------------------------------------

def test_a_location_is_never_a_placeholder():
    """A problem raised where no file is known says 'error:', and the CLI gives a graph-key problem the graph's
    file; a flag problem names the flag."""
    from dflash_graph.errors import GraphError, Location, Problem

    assert Problem("x").render() == "error: x"
    e = GraphError([Problem("bad holdout", Location(path="data.holdout")), Problem("bad flag", Location(flag="--plot x"))])
    text = str(e.in_file("graphs/tiny.toml"))
    assert text.splitlines()[0] == "graphs/tiny.toml: error at data.holdout: bad holdout"
    assert text.splitlines()[1] == "--plot x: error: bad flag"


def test_holdout_error_names_the_graph_file_and_line(in_repo, tmp_path, capsys):
    """[data] holdout is read with the data, after the graph is loaded: its error still names the graph's file and
    line (or the --set flag that gave the value), never '<graph>'."""
    assert main(["run", G, "--out", str(tmp_path / "o"), "--set", "data.holdout=100000"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"{G}: --set data.holdout=100000: error at data.holdout"), first
    graph = tmp_path / "g.toml"
    text = Path(G).read_text().replace('"tiny/', f'"{(Path(G).parent / "tiny").resolve()}/')
    graph.write_text(text.replace("holdout = 50 ", "holdout = 100000 ", 1))
    line = next(i for i, ln in enumerate(graph.read_text().splitlines(), 1) if ln.startswith("holdout = 100000"))
    assert main(["run", str(graph), "--out", str(tmp_path / "o")]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"{graph}:{line}: error at data.holdout"), first


def test_draw_into_a_missing_directory_names_the_flag(in_repo, tmp_path, capsys):
    assert main(["draw", G, "-o", str(tmp_path / "no" / "g.svg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"-o {tmp_path / 'no' / 'g.svg'}: error: its directory") and "error::" not in err


def test_a_second_ctrl_c_says_which_checkpoint_is_kept(in_repo, tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt out of a step (what a second Ctrl-C raises) stops at once: the message names the step
    whose checkpoint is on disk, read back, or says that none was saved; never '(if any)'."""
    from dflash_graph.train.trainer import Trainer

    orig = Trainer.step

    def step(self, i):
        if i + 1 == stop_at:
            raise KeyboardInterrupt
        return orig(self, i)

    monkeypatch.setattr(Trainer, "step", step)
    for stop_at, said in ((3, "kept the checkpoint of step 2"), (1, "no checkpoint was saved yet")):
        out = tmp_path / f"stop{stop_at}"
        code = main(["run", G, "--steps", "4", "--out", str(out), "--no-progress", "--set", "train.eval_every=0",
                     "--set", "train.checkpoint_every=2", "--set", "dims.seq=64", "--set", "dims.anchors=4"])
        err = capsys.readouterr().err
        assert code == 130, err
        assert said in err and "(if any)" not in err, err
        # the linear-attention note: the tiny target's kernels are the ones check assumed, so nothing is said
        assert "reference kernels" not in err and "linear attention" not in err, err


def test_kernel_notes_only_for_linear_layers_on_other_kernels():
    import attrs

    from dflash_graph.models.qwen3_5 import Qwen35Dims, installed_linear_kernels, kernel_notes

    cfg = json.loads((Path(__file__).resolve().parent.parent / "graphs" / "tiny" / "config.json").read_text())
    here = installed_linear_kernels()
    other = "fla" if here == "torch" else "torch"

    class M:
        def __init__(self, dims):
            self.dims = dims

    d = Qwen35Dims.from_config(cfg)
    assert kernel_notes({"t": M(attrs.evolve(d, linear_kernels=here))}) == []
    notes = kernel_notes({"t": M(attrs.evolve(d, linear_kernels=other))})
    assert len(notes) == 1 and "models.t.linear_kernels" in notes[0]
    full = attrs.evolve(d, linear_kernels=other, layer_types=("full_attention",) * len(d.layer_types))
    assert kernel_notes({"t": M(full)}) == []


def test_transformers_kernel_fallback_warning_is_dropped():
    import logging

    from dflash_graph.exec.models import _KernelFallbackNote

    f = _KernelFallbackNote()
    rec = logging.LogRecord("transformers.integrations.hub_kernels", logging.WARNING, __file__, 1,
                            "`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
                            "`flash-linear-attention` is not installed.", None, None)
    assert f.filter(rec) is False
    other = logging.LogRecord("transformers", logging.WARNING, __file__, 1, "something else", None, None)
    assert f.filter(other) is True
