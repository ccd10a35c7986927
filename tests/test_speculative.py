"""Real speculative decoding (train/speculative.py) is lossless: its output is target-only greedy decoding, token
for token, whatever the drafter proposes; the acceptance it reports is what greedy verification accepted; and
`eval` / `export` work end to end on a trained run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_graph.cli.main import main
from dflash_graph.exec.devices import torch_devices
from dflash_graph.exec.models import ModelStore
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.train.speculative import Decoder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    plan = compile_graph(str(REPO / "graphs" / "tiny.toml"))
    store = ModelStore(plan.typed, torch_devices(plan.typed.ctx.spec))
    target = store.full("target", "cpu")
    drafter = store.drafter("drafter", "cpu").eval()
    yield target, drafter
    torch.set_num_threads(n)


class Oracle(Decoder):
    """Proposes the true greedy continuation, except at chosen output positions: the accepted run is known."""

    def __init__(self, *a, truth, prompt_len, wrong, **k):
        super().__init__(*a, **k)
        self.truth, self.prompt_len, self.wrong = truth, prompt_len, wrong
        self.proposed = []

    def propose(self, ids, feats, anchor):
        out = []
        for k in range(1, self.block):
            i = anchor + k - self.prompt_len                    # index into the new tokens
            tok = self.truth[i] if i < len(self.truth) else 0
            out.append((tok + 1) % 700 if i in self.wrong else tok)
        self.proposed.append(out)
        return out


PROMPT = "Q: What color is the fox? A: The fox is"


def test_speculative_output_is_target_only_greedy(models):
    from dflash_graph.train.corpus import load_tokenizer

    target, drafter = models
    tok = load_tokenizer(REPO / "graphs" / "tiny" / "tokenizer.json")
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    plain = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id)
    truth = plain.greedy(prompt, 20)
    assert len(truth) == 20 or truth[-1] == tok.eos_token_id
    wrong = {3, 4, 9}
    dec = Oracle(target, drafter, [1, 3], 4, tok.eos_token_id, truth=truth, prompt_len=len(prompt), wrong=wrong)
    out, accepted = dec.speculative(prompt, 20)
    assert out == truth                                              # lossless
    # replay greedy verification by hand: a round starting after token i accepts up to the first wrong slot
    expect, i = [], 1                                                # the prefill gives token 0
    while i < len(truth):
        n = 0
        while n < 3 and i + n not in wrong and i + n < len(truth):
            n += 1
        expect.append(n)
        i += n + 1
    assert accepted[: len(expect)] == expect
    assert dec.forwards == 1 + len(accepted) < 1 + len(truth)       # fewer target forwards than tokens
    # the real (untrained) drafter: whatever it proposes, the output is still greedy's
    out2, _ = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id).speculative(prompt, 20)
    assert out2 == truth


def test_eval_and_export_on_a_trained_run(in_repo, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "graphs/tiny.toml", "--steps", "3", "--out", str(out), "--no-progress"]) == 0
    assert (out / "export" / "config.json").exists() and (out / "export" / "model.safetensors").exists()
    capsys.readouterr()
    code = main(["eval", "graphs/tiny.toml", "--checkpoint", str(out), "--prompts", "2", "--max-new-tokens", "8",
                 "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and res["identical_to_greedy"] == res["prompts"] == 2
    assert res["tau"] >= 1 and res["tokens_per_target_forward"] >= 1 and res["block"] == 4
    assert len(res["slot_accept"]) == 3
    assert [b["name"] for b in res["benchmarks"]] == ["held-out"] and res["benchmarks"][0]["lossless"] is True
    # benchmark files: one row each, in --json as `benchmarks`, beside the held-out tau training measured
    bench = ["--bench", "graphs/tiny/bench/gsm8k.jsonl", "--bench", "graphs/tiny/bench/mtbench.jsonl"]
    code = main(["eval", "graphs/tiny.toml", "--checkpoint", str(out), *bench, "--prompts", "1",
                 "--max-new-tokens", "4", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [b["name"] for b in res["benchmarks"]] == ["gsm8k", "mtbench"]
    for b in res["benchmarks"]:
        assert {"name", "tau", "speedup", "accept_per_slot", "lossless"} <= set(b) and b["lossless"] is True
        assert b["prompts"] == 1 and b["tau"] >= 1 and len(b["accept_per_slot"]) == 3
    held = [json.loads(line)["heldout"] for line in open(out / "metrics.jsonl") if "heldout" in line][-1]
    assert res["predicted_tau"]["tau"] == held["tau"] and res["predicted_tau"]["step"] == 3
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(out), *bench[:2], "--prompts", "1",
                 "--max-new-tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "benchmark  prompts  tau" in table and "\ngsm8k " in table and f"training predicted tau {held['tau']}" in table
    assert main(["export", str(out), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["torch_dtype"] == "float32"


def test_export_of_a_directory_without_a_run_says_what_to_do(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no run.json" in err and "--graph" in err and "Traceback" not in err


def test_eval_memory_counts_the_weights_eval_builds(models):
    """eval_need's weights are the parameter bytes of the modules eval builds (tiny: target and drafter)."""
    from dflash_graph.cli.evaluate import eval_need
    from dflash_graph.exec.memtrack import LiveTracker
    from dflash_graph.models.nn.target import body_forward, final_norm, lm_head

    plan = compile_graph(str(REPO / "graphs" / "tiny.toml"), rewrite=False)
    target, drafter = models                                   # built by the ModelStore, as eval builds them
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())   # noqa: E731
    t = 40
    need = eval_need(plan, "drafter", "target", t)
    assert need["target weights"] == size(target) and need["drafter weights"] == size(drafter)
    # measured (LiveTracker, as torch's MemTracker counts): the weights, then one target forward over t tokens and
    # its logits as the decoders compute them; eval_need is a lower bound of that peak, its logits term exact
    with torch.no_grad(), LiveTracker() as tr:
        tr.charge("cpu")
        for p in [*target.parameters(), *drafter.parameters()]:
            tr.adopt(p, "cpu")
        last, _ = body_forward(target, torch.arange(t) % 700, torch.arange(t), [])
        logits = lm_head(target)(final_norm(target)(last))
    assert logits.numel() * logits.element_size() == need["logits"] == t * 768 * 4
    assert sum(need.values()) <= tr.peak["cpu"] <= 2 * sum(need.values())
