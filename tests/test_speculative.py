"""Real speculative decoding (train/speculative.py) is lossless: with the target's KV cache and the drafter's context
cache, its greedy output is target-only greedy decoding, token for token, whatever the drafter proposes, for a
Qwen3.5 target (Gated DeltaNet states rolled back after a rejection) and a Qwen3 one; sampled, the speculative-
sampling rule (train/sampling.py) emits the target's distribution (chi-square tests, seeded); the acceptance it
reports is what verification accepted; and `eval` / `export` work end to end on a trained run."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from dflash_graph.cli.main import main
from dflash_graph.exec.devices import torch_devices
from dflash_graph.exec.models import ModelStore
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.train import speculative
from dflash_graph.train.sampling import Sampling, draw, verify_sampling
from dflash_graph.train.speculative import Decoder

REPO = Path(__file__).resolve().parents[1]
ALPHA = 0.01            # the significance level of every distribution test here (Bonferroni over its positions)


def _models(graph: str, float32: bool = False):
    plan = compile_graph(str(REPO / "graphs" / graph))
    store = ModelStore(plan.typed, torch_devices(plan.typed.ctx.spec))
    target = store.full("target", "cpu")
    drafter = store.drafter("drafter", "cpu").eval()
    if float32:     # bf16 rounds a 1-token and a B-token forward differently: near-ties in a random bf16 target flip
        target, drafter = target.float(), drafter.float()
    return target, drafter


@pytest.fixture(scope="module")
def models():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _models("tiny.toml")
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    from dflash_graph.train.corpus import load_tokenizer

    return load_tokenizer(REPO / "graphs" / "tiny" / "tokenizer.json")


class Oracle(Decoder):
    """Proposes the true greedy continuation, except at chosen output positions: the accepted run is known."""

    def __init__(self, *a, truth, prompt_len, wrong, **k):
        super().__init__(*a, **k)
        self.truth, self.prompt_len, self.wrong = truth, prompt_len, wrong
        self.proposed = []

    def propose(self, ctx, anchor_token, anchor, sampling, generator):
        assert len(ctx) == anchor                                    # the context cache: every position before it
        out = []
        for k in range(1, self.block):
            i = anchor + k - self.prompt_len                    # index into the new tokens
            tok = self.truth[i] if i < len(self.truth) else 0
            out.append((tok + 1) % 700 if i in self.wrong else tok)
        self.proposed.append(out)
        return out, None


PROMPT = "Q: What color is the fox? A: The fox is"


def test_speculative_output_is_target_only_greedy(models, tok):
    target, drafter = models
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    plain = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id)
    truth = plain.greedy(prompt, 20)
    assert plain.forwards == len(truth)                              # the KV cache: one forward per token
    assert len(truth) == 20 or truth[-1] == tok.eos_token_id
    wrong = {3, 4, 9, 10, 11}                                        # rounds accepting 2, 0, 3, 1, 0, ... drafts
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
    assert accepted[: len(expect)] == expect and 0 in expect and 3 in expect
    assert dec.forwards == 1 + len(accepted) < 1 + len(truth)       # fewer target forwards than tokens
    # the real (untrained) drafter: whatever it proposes, the output is still greedy's
    out2, _ = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id).speculative(prompt, 20)
    assert out2 == truth


def test_greedy_multi_turn_speculative_decoding_asks_and_answers_the_same_turns(models, tok):
    """MT-Bench's records, two turns each (graphs/tiny/bench/mtbench.jsonl): each side asks turn 2 after its own
    answer to turn 1, and greedy, both sides ask and answer the same turns (FastChat's multi-turn loop)."""
    from test_eval_bench import BENCH, Asked

    from dflash_graph.train.bench import read_bench

    target, drafter = models
    dec = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id)
    _, dialogues = read_bench(BENCH / "mtbench.jsonl", 2)
    asked = [Asked(tok, d) for d in dialogues]
    res = speculative.measure(dec, asked, 12)
    assert (res["prompts"], res["turns"], res["identical_to_greedy"]) == (2, 4, 4)
    assert res["lossless"] is True and res["divergences"] == [] and res["lossless_per_prompt"] == [True, True]
    assert res["rounds"] >= 4 and res["tokens"] > 4
    for chat in asked:
        # per turn, speculative then target-only: the same prompt on both sides
        (a1, c1), (b1, d1), (a2, c2), (b2, d2) = chat.asked
        assert a1 == b1 == [] and c1 == d1 == [{"role": "user", "content": chat.dialogue.turns[0]}]
        assert a2 == b2 and len(a2) == 1 and c2 == d2          # turn 2 after the same answer to turn 1
        assert c2[1] == {"role": "assistant", "content": tok.decode(a2[0], skip_special_tokens=True).strip()}
        assert c2[1]["content"] and c2[2] == {"role": "user", "content": chat.dialogue.turns[1]}


def _rollback_error(dec: Decoder, ids: list[int], keep: int | None = None) -> list[float]:
    """For r = 0 .. B-1 drafts rejected: prefill ids[:-B], verify the block ids[-B:] (recording), crop r tokens,
    run the next token; the largest difference of its logits from a forward without a cache over the same tokens.
    ``keep``: record that many recurrent states instead of the decoder's B."""
    B, n = dec.block, len(ids) - dec.block
    errs = []
    for r in range(B):
        cache = dec.new_cache()
        dec._target(ids[:n], 0, cache, False)
        if keep is None:
            dec._start_recording(cache)
        else:
            cache.activate_past_recording(recurrent_states_to_keep=keep)
        dec._target(ids[n:], n, cache, False)
        dec._cut(cache, r)
        m = len(ids) - r
        nxt = 7                                                    # any next token, at position m
        got = dec._target([nxt], m, cache, False)[0][-1]
        want = dec._target(ids[:m] + [nxt], 0, None, False)[0][-1]
        errs.append(float((got - want).abs().max()))
    return errs


def test_the_target_cache_rolls_back_exactly_after_a_rejection(models):
    """A Qwen3.5 target's cache cut back after r of B-1 drafts were rejected (r = 0 .. B-1) continues exactly as a
    forward that never saw them: its attention K/V are cropped and its Gated DeltaNet states put back to the state
    after the last kept token (NOTE [The target's cache after a rejection]). Recording only B-1 states, as
    transformers' own assisted decoding does for its candidates, loses the state after the anchor when every
    draft is rejected: the test sees it."""
    target, drafter = models
    dec = Decoder(target, drafter, [1, 3], 4, None)
    ids = torch.randint(2, 700, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        good = _rollback_error(dec, ids)
        bad = _rollback_error(dec, ids, keep=dec.block - 1)
    assert max(good) < 1e-4, good
    assert bad[-1] > 1e-2 and max(bad[:-1]) < 1e-4, bad


def test_the_drafter_context_cache_equals_its_forward(models):
    """The cached path (context rows' K/V appended round by round, one block) is the training forward's block."""
    _, drafter = models
    g = torch.Generator().manual_seed(0)
    t = 11
    feats = torch.randn(t, drafter.dims.fc_in_features, generator=g)
    ids = torch.randint(2, 700, (t,), generator=g)
    with torch.no_grad():
        want = drafter(feats, ids, torch.arange(t), torch.tensor([t - 1]))[0]
        ctx = drafter.new_cache()
        drafter.extend_context(ctx, feats[:6], torch.arange(6))
        drafter.extend_context(ctx, feats[6:t - 1], torch.arange(6, t - 1))
        got = drafter.block_hidden(ctx, int(ids[t - 1]), t - 1)
    assert len(ctx) == t - 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_qwen3_target_decodes_losslessly_with_its_cache(tok):
    target, drafter = _models("tiny_qwen3.toml", float32=True)
    dec = Decoder(target, drafter, [1, 3], 4, tok.eos_token_id)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in (PROMPT, "Once upon a time")]
    res = speculative.measure(dec, prompts, 16)
    assert res["lossless"] is True and res["identical_to_greedy"] == 2 and res["lossless_per_prompt"] == [True, True]
    assert res["greedy_tokens_per_target_forward"] == 1.0 and res["rounds"] >= 1


# ---------------------------------------------------------------------------------------------------- sampling
def chi_square(a: list, b: list, min_count: int = 10) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of Pearson's chi-square test that two samples of categories come
    from one distribution (a 2 x K contingency table; categories seen fewer than ``min_count`` times in both samples
    together are pooled into one). The p-value is the chi-square survival function, Q(df/2, x/2)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keep = sorted(c for c in set(ca) | set(cb) if ca[c] + cb[c] >= min_count)
    rest = [sum(n for c, n in cnt.items() if c not in keep) for cnt in (ca, cb)]
    obs = torch.tensor([[ca[c] for c in keep] + [rest[0]], [cb[c] for c in keep] + [rest[1]]], dtype=torch.float64)
    obs = obs[:, obs.sum(0) > 0]
    exp = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    x = float(((obs - exp) ** 2 / exp).sum())
    df = obs.shape[1] - 1
    half = torch.tensor([df / 2, x / 2], dtype=torch.float64)
    p = float(torch.special.gammaincc(half[0], half[1]))
    return x, df, p


def always_accept(drafts, p, q, generator):
    k = drafts.numel()
    return k, int(draw(p[k], generator))


def resample_from_p(drafts, p, q, generator):
    """The acceptance test right, but a rejected slot drawn from p instead of the residual norm(max(0, p - q))."""
    k = drafts.numel()
    idx = drafts.view(k, 1)
    u = torch.rand(k, generator=generator)
    n = int((u * q.gather(-1, idx)[:, 0] < p[:k].gather(-1, idx)[:, 0]).to(torch.int64).cumprod(0).sum())
    return n, int(draw(p[n], generator))


def _rule_outputs(rule, p, q, n, seed=0):
    """The first emitted token of a block (slot 1's accepted draft, or its replacement) over n seeded rounds."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        drafts = draw(q, g)
        acc, nxt = rule(drafts, p, q, g)
        out.append(int(drafts[0]) if acc >= 1 else nxt)
    return out


def test_the_speculative_sampling_rule_emits_the_target_distribution():
    """The rule alone, on a 6-token vocabulary where p and q overlap: slot 1's emitted token is distributed as p_1
    (chi-square against direct draws from p_1 at ALPHA); the two broken rules, always accepting and resampling a
    rejected slot from p, are each refused by the same test."""
    p = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05, 0.00], [0.2] * 5 + [0.0]], dtype=torch.float32)
    q = torch.tensor([[0.10, 0.45, 0.05, 0.10, 0.10, 0.20]], dtype=torch.float32)
    n = 1500
    g = torch.Generator().manual_seed(1)
    direct = draw(p[0].expand(n, -1), g).tolist()
    x, df, pv = chi_square(_rule_outputs(verify_sampling, p, q, n), direct)
    print(f"speculative-sampling rule vs p: chi2 {x:.2f}, df {df}, p-value {pv:.3g} (alpha {ALPHA})")
    assert pv > ALPHA
    for broken in (always_accept, resample_from_p):
        x, df, pv = chi_square(_rule_outputs(broken, p, q, n), direct)
        print(f"{broken.__name__} vs p: chi2 {x:.2f}, df {df}, p-value {pv:.3g}")
        assert pv < ALPHA


def test_top_p_keeps_the_nucleus():
    s = Sampling(1.0, 0.7)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(s.probs(logits), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert Sampling(1.0, 0.4).probs(logits).tolist() == [1.0, 0.0, 0.0, 0.0]       # the first token always stays


def _first_tokens(decode, prompt, n_new, sampling, seeds):
    return [decode(prompt, n_new, sampling, torch.Generator().manual_seed(s)) for s in seeds]


@pytest.mark.slow
def test_speculative_sampling_on_the_tiny_model_is_target_only_sampling_in_distribution(models, tok, monkeypatch):
    """End to end on tiny (Qwen3.5 target, the untrained drafter): the tokens at output positions 2 and 3 (those
    the first block verifies; position 1 comes from the prompt's forward in both) over 400 seeds each, speculative vs
    target-only sampling at temperature 0.9, top-p 0.95: a chi-square test per position at ALPHA / 2 passes; with
    the always-accept rule it fails."""
    target, drafter = models
    dec = Decoder(target, drafter, [1, 3], 4, None)
    prompt = tok("The fox", add_special_tokens=False)["input_ids"]
    sampling, n = Sampling(0.9, 0.95), 400
    # independent samples: other seeds for each side (with one seed both draw the same first token)
    base = _first_tokens(dec.target_only, prompt, 3, sampling, range(n))
    spec = _first_tokens(lambda *a: dec.speculative(*a)[0], prompt, 3, sampling, range(n, 2 * n))
    for pos in (1, 2):
        x, df, pv = chi_square([o[pos] for o in spec], [o[pos] for o in base])
        print(f"position {pos + 1}: chi2 {x:.2f}, df {df}, p-value {pv:.3g} (alpha {ALPHA / 2})")
        assert pv > ALPHA / 2
    monkeypatch.setattr(speculative, "verify_sampling", always_accept)
    bad = _first_tokens(lambda *a: dec.speculative(*a)[0], prompt, 3, sampling, range(n, 2 * n))
    x, df, pv = chi_square([o[1] for o in bad], [o[1] for o in base])
    print(f"always-accept, position 2: chi2 {x:.2f}, df {df}, p-value {pv:.3g}")
    assert pv < ALPHA / 2


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
    # MT-Bench's record has two turns: both decoded on both sides and counted (greedy: identical turn for turn)
    assert [(b["turns"], b["identical_to_greedy"], b["divergences"]) for b in res["benchmarks"]] == [(1, 1, []),
                                                                                                  (2, 2, [])]
    assert res["chat_template_kwargs"] == {}
    held = [json.loads(line)["heldout"] for line in open(out / "metrics.jsonl") if "heldout" in line][-1]
    assert res["predicted_tau"]["tau"] == held["tau"] and res["predicted_tau"]["step"] == 3
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(out), *bench[:2], "--prompts", "1",
                 "--max-new-tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "benchmark  prompts  turns  tau" in table and "\ngsm8k " in table and f"training predicted tau {held['tau']}" in table
    code = main(["eval", "graphs/tiny.toml", "--checkpoint", str(out), "--prompts", "2", "--max-new-tokens", "8",
                 "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and res["lossless"] is None and res["lossless_per_prompt"] == [None, None]
    assert (res["temperature"], res["top_p"], res["seed"], res["kv_cache"]) == (0.7, 0.9, 3, True)
    assert res["speculative_decode_tokens_per_s"] > 0 and res["decode_speedup"] > 0
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


@pytest.mark.parametrize("flag,value", [("--temperature", "-0.5"), ("--temperature", "nan"), ("--top-p", "0"),
                                        ("--top-p", "1.5"), ("--seed", "-1")])
def test_eval_refuses_a_bad_sampling_flag_before_loading(tmp_path, capsys, flag, value):
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "expected:" in err and "hint:" in err and "Traceback" not in err
