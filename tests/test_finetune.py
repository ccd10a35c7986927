"""Fine-tuning a published drafter (issue 23, points 4 and 5): `[models.drafter] weights = PATH` starts the drafter
from a DFlash draft checkpoint, in the format `export` (and z-lab) writes or in speculators'; check compares it with
the graph without torch; the drafter then computes the checkpoint's logits at step 0, and `run` trains from it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_graph.cli.main import main
from dflash_graph.errors import GraphError
from dflash_graph.exec.devices import torch_devices
from dflash_graph.exec.models import ModelStore
from dflash_graph.models import published
from dflash_graph.models.nn.target import final_norm, lm_head
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.train.export import export

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "graphs" / "tiny.toml")


def store_of(*overrides: str) -> ModelStore:
    plan = compile_graph(TINY, overrides)
    store = ModelStore(plan.typed, torch_devices(plan.typed.ctx.spec))
    store.preload()
    return store


def as_speculators(src: Path, out: Path) -> Path:
    """`src` (export's format) rewritten as speculators 0.9.0 saves a DFlash drafter: the same tensors, the
    config as DFlashSpeculatorConfig.to_dict() writes it (speculators/models/dflash/config.py; the layer ids
    as hidden_states indices, speculators/convert/dflash/converter.py)."""
    out.mkdir()
    shutil.copy(src / "model.safetensors", out / "model.safetensors")
    z = json.loads((src / "config.json").read_text())
    d = z["dflash_config"]
    layers = {k: v for k, v in z.items() if k not in ("architectures", "block_size", "dflash_config",
                                                       "num_target_layers")}
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
        "transformer_layer_config": layers, "draft_vocab_size": z["vocab_size"], "block_size": d["block_size"],
        "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in d["target_layer_ids"]],
        "mask_token_id": d["mask_token_id"], "sample_from_anchor": False,
        "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "tiny"}}}))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny graph's drafter with every weight moved off its init, exported in float32."""
    store = store_of()
    drafter = store.drafters["drafter"]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    target = store.full("target", "cpu")
    out = tmp_path_factory.mktemp("published") / "zlab"
    export(drafter, store.typed.ctx.models["drafter"].dims, final_norm(target).weight, target.config, out,
           "float32", norm_plus_one=True)
    return store, out


def logits(store: ModelStore) -> torch.Tensor:
    dims = store.typed.ctx.models["drafter"].dims
    g = torch.Generator().manual_seed(0)
    t = 48
    ctx = torch.randn(t, dims.fc_in_features, generator=g)
    ids = torch.randint(2, dims.vocab_size, (t,), generator=g)
    pos = torch.cat([torch.arange(20), torch.arange(t - 20)])         # two packed documents
    target = store.full("target", "cpu")
    with torch.no_grad():
        h = store.drafters["drafter"](ctx, ids, pos, torch.tensor([2, 11, 25, 40]))
        return lm_head(target)(final_norm(target)(h))


@pytest.mark.parametrize("fmt", ["z-lab", "speculators"])
def test_export_then_load_gives_the_same_logits_at_step_0(trained, tmp_path, fmt):
    store, out = trained
    path = out if fmt == "z-lab" else as_speculators(out, tmp_path / "spec")
    assert published.read(path).format == fmt
    loaded = store_of(f"models.drafter.weights={path}")
    ours, theirs = store.drafters["drafter"].state_dict(), loaded.drafters["drafter"].state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(logits(store), logits(loaded))


def test_a_checkpoint_with_a_final_norm_of_its_own_is_refused_at_run(trained, tmp_path):
    """The graph trains through the target's frozen norm: a checkpoint whose norm.weight was trained (z-lab's
    published drafters) would not start from its own logits, so the store refuses it, located."""
    store, out = trained
    other = tmp_path / "own_norm"
    target = store.full("target", "cpu")
    export(store.drafters["drafter"], store.typed.ctx.models["drafter"].dims, final_norm(target).weight + 0.25,
           target.config, other, "float32", norm_plus_one=True)
    with pytest.raises(GraphError) as e:
        store_of(f"models.drafter.weights={other}")
    msg = str(e.value)
    assert "error at models.drafter.weights" in msg and "final norm of its own" in msg and "by 0.25" in msg


def test_the_format_names_and_shapes_are_the_drafters(trained):
    """models/published.py's names and shapes, written without torch, are DFlashDrafter's state dict, and
    export's names read back to the same (one adapter, both directions)."""
    store, out = trained
    sd = store.drafters["drafter"].state_dict()
    want = published.expected_shapes(store.typed.ctx.models["drafter"].dims)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: s for k, s in want.items() if k != published.NORM}
    assert all(published.import_name(published.export_name(k)) == k for k in sd)
    header = published.safetensors_header(out / "model.safetensors")
    assert {published.import_name(k): s for k, (s, _) in header.items()} == want


def test_qwen3_defaults_are_transformers():
    from transformers import Qwen3Config

    c = Qwen3Config()
    assert published.QWEN3_DEFAULTS == {"rms_norm_eps": c.rms_norm_eps,
                                        "rope_theta": c.rope_parameters["rope_theta"]}


def test_check_reads_a_checkpoint_without_torch(trained):
    """check compares a drafter's checkpoint with the graph in a process that never imports torch."""
    _, out = trained
    code = ("import sys; from dflash_graph.cli.main import main; "
            f"rc = main(['check', {TINY!r}, '--set', 'models.drafter.weights={out}', '--set', 'dims.block=8']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert "error at models.drafter.config.block_size" in p.stderr and "trained with block_size = 4" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_checkpoints_target_layers_are_checked_like_the_hooks(trained, tmp_path, in_repo, capsys):
    """tiny.toml hooks and concatenates layers [1, 3] and declares them; a checkpoint trained on [3, 1] (the same
    fc width) is refused at the drafter's target_layer_ids, naming both lists and the hooks to change."""
    _, out = trained
    other = tmp_path / "swapped"
    shutil.copytree(out, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [3, 1]
    (other / "config.json").write_text(json.dumps(cfg))
    assert main(["check", "graphs/tiny.toml", "--set", f"models.drafter.weights={other}"]) == 2
    err = capsys.readouterr().err
    assert "error at models.drafter.config.target_layer_ids" in err
    assert "expected: target_layer_ids = [3, 1] (the checkpoint's config.json)" in err
    assert "actual:   target_layer_ids = [1, 3] (the graph's drafter)" in err
    assert "hook and concatenate the target's layers [3, 1] in that order" in err


SPECULATORS = {"speculators_model_type": "dflash", "block_size": 4, "mask_token_id": 1, "draft_vocab_size": 128,
               "aux_hidden_state_layer_ids": [2, 4],
               "transformer_layer_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                                            "vocab_size": 128}}


def test_speculators_layer_ids_are_hidden_states_indices():
    fmt, cfg, _ = published.read_config(SPECULATORS)
    assert fmt == "speculators" and cfg["target_layer_ids"] == [1, 3]
    assert (cfg["rms_norm_eps"], cfg["rope_theta"]) == (published.QWEN3_DEFAULTS["rms_norm_eps"],
                                                        published.QWEN3_DEFAULTS["rope_theta"])


@pytest.mark.parametrize("change,words", [
    ({"draft_vocab_size": 64}, "reduced vocabulary of 64 tokens"),
    ({"sample_from_anchor": True}, "sample from the anchor slot"),
    ({"aux_hidden_state_layer_ids": [0, 2]}, "reads hidden_states[0], the target's embeddings"),
    ({"speculators_model_type": "eagle3"}, "a speculators 'eagle3' model, not a DFlash drafter"),
    ({"transformer_layer_config": {**SPECULATORS["transformer_layer_config"],
                                   "layer_types": ["sliding_attention"]}}, "layer types ['sliding_attention']"),
])
def test_speculators_drafters_this_project_cannot_be_are_refused(change, words):
    with pytest.raises(published.CheckpointError) as e:
        published.read_config({**SPECULATORS, **change})
    assert words in str(e.value) and e.value.hint


def test_run_refuses_a_missing_checkpoint(in_repo, tmp_path, capsys):
    assert main(["run", "graphs/tiny.toml", "--set", "models.drafter.weights=no/such/drafter", "--steps", "1",
                 "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error at models.drafter.weights" in err and "no such file or directory" in err
    assert not (tmp_path / "r").exists()


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"step"' in line and '"loss"' in line and "held_out" not in line]


@pytest.mark.slow
def test_run_trains_from_a_published_drafter(in_repo, tmp_path):
    """A run that starts from another run's export (bf16, as `run` writes it) begins where that one ended: its
    first loss, on the same first batch, is below the first loss of a run from scratch."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", "graphs/tiny.toml", "--steps", "3", "--out", str(a), "--no-progress"]) == 0
    assert main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(b), "--no-progress",
                 "--set", f"models.drafter.weights={a / 'export'}"]) == 0
    scratch, tuned = _losses(a), _losses(b)
    assert tuned[0] < scratch[0] and tuned[0] < scratch[1]
    assert json.loads((b / "export" / "config.json").read_text())["dflash_config"] == \
        json.loads((a / "export" / "config.json").read_text())["dflash_config"]
