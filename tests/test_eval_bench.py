"""`eval --bench`: every shipped sample file (graphs/tiny/bench/, one per published benchmark format) is read in its
format and rendered through the target's chat template; MT-Bench is asked turn by turn, each turn after the answer
each side decoded (greedy: both sides ask the same turns and give the same answers; a divergence is reported); a
file of no known format is refused at its line with the keys it has; --chat-template-kwarg reaches the template and
is refused when the template does not read it; and eval refuses, before it builds any model, a graph that differs
from the run's (block, target_layer_ids, ...), bad flags, and a target that does not fit the device (the 27B graph
on this host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_graph.cli.main import main
from dflash_graph.errors import GraphError
from dflash_graph.train.bench import BY_NAME, FORMATS, Chat, chats, detect, heldout_tau, read_bench

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "graphs" / "tiny" / "bench"

# what each sample's first record asks, as the user turn the decoder answers
FIRST_TURN = {
    "mtbench": "Tell me about the rabbit.",
    "gsm8k": "What is six plus ten?",
    "humaneval": "Complete this Python function:\n\ndef count_by(step, start, n):",
    "mbpp": "Write a function to count by 5 from 3.\nYour code should pass these tests:\nassert count5(2) == [3, 8]",
    "math500": "What is nine plus three?",
    "messages": "What color is the horse?",
    "prompt": "Count by 5 from 3, 10 numbers.",
}


@pytest.fixture(scope="module")
def tok():
    from dflash_graph.train.corpus import load_tokenizer

    return load_tokenizer(REPO / "graphs" / "tiny" / "tokenizer.json")


def test_a_sample_file_ships_for_every_format():
    assert sorted(p.stem for p in BENCH.glob("*.jsonl")) == sorted(BY_NAME) == sorted(FIRST_TURN)


@pytest.mark.parametrize("name", sorted(FIRST_TURN))
def test_each_sample_file_is_read_in_its_format_and_templated(name, tok):
    fmt, dialogues = read_bench(BENCH / f"{name}.jsonl", 100)
    lines = [json.loads(x) for x in (BENCH / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    assert fmt == name and len(dialogues) == len(lines)
    first = dialogues[0].conversation([])
    assert first[-1]["role"] == "user" and first[-1]["content"].startswith(FIRST_TURN[name])
    for rec, d in zip(lines, dialogues):     # the reference answer is never part of the prompt
        text = " ".join([c for _, c in d.history] + list(d.turns))
        for key in ("answer", "solution", "code", "canonical_solution"):
            if isinstance(rec.get(key), str) and len(rec[key]) > 3:
                assert rec[key] not in text
    assert read_bench(BENCH / f"{name}.jsonl", 1)[1] == dialogues[:1]        # --prompts N: the first N records
    ids = chats(tok, dialogues, name)[0].ids()
    text = tok.decode(ids)
    # the chat template's rendering with the generation prompt: the user turn, then the assistant's cue
    assert text == tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant:") and "user: " in text


def test_mtbench_asks_every_turn_after_the_answer_decoded_for_the_one_before(tok):
    _, dialogues = read_bench(BENCH / "mtbench.jsonl", 10)
    recs = [json.loads(x) for x in (BENCH / "mtbench.jsonl").read_text().splitlines()]
    assert [list(d.turns) for d in dialogues] == [r["turns"] for r in recs] and all(len(r["turns"]) == 2 for r in recs)
    chat = chats(tok, dialogues, "mtbench")[1]
    answer = tok("Fifteen.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]     # as decoded: eos last
    conv = chat.conversation([answer])
    # turn 2 (FastChat's gen_model_answer.py): turn 1, the answer decoded for it as the assistant message (special
    # tokens removed, stripped), then turn 2, rendered with the generation prompt
    assert conv == [{"role": "user", "content": "What is seven plus eight?"},
                    {"role": "assistant", "content": "Fifteen."},
                    {"role": "user", "content": "And what is that minus 5?"}]
    assert tok.decode(chat.ids([answer])) == ("user: What is seven plus eight?\nassistant: Fifteen.\n"
                                             "user: And what is that minus 5?\nassistant:")
    assert chat.turns == 2 and chat.longest(10) == len(chat.ids([[]])) + 10
    with pytest.raises(IndexError):
        chat.conversation([answer, answer])


def test_messages_are_asked_once_after_the_last_user_message():
    _, dialogues = read_bench(BENCH / "messages.jsonl", 10)
    assert [m["role"] for m in dialogues[1].conversation([])] == ["user", "assistant", "user"]
    assert dialogues[1].turns == ("Tell me about the owl.",)
    assert dialogues[1].history[1] == ("assistant", "6 minus 2 is 4.")        # the record's own answer: history


def test_detection_prefers_the_specific_format():
    he = {"task_id": "x", "prompt": "def f():", "entry_point": "f"}
    assert detect(he).name == "humaneval" and detect({"prompt": "hi"}).name == "prompt"
    assert detect({"question": "q", "answer": "a"}).name == "gsm8k" and detect({"q": 1}) is None
    assert [f.name for f in FORMATS].index("humaneval") < [f.name for f in FORMATS].index("prompt")


def test_a_record_of_no_known_format_is_refused_at_its_line(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"question": "What is one plus one?", "answer": "2"}\n\n{"query": "hi", "id": 3}\n')
    with pytest.raises(GraphError) as e:
        read_bench(f, 10, None)
    msg = str(e.value)
    # line 3 is of another format than the file's (gsm8k, from line 1): named with the keys found
    assert f"{f}:3" in msg and "keys found: id, query" in msg and "'question'" in msg
    f.write_text('{"query": "hi"}\n')
    msg = str(pytest.raises(GraphError, read_bench, f, 10, None).value)
    assert f"{f}:1" in msg and "keys found: query" in msg and "--bench-format" in msg and "mtbench: turns" in msg
    f.write_text('{"prompt": "hi"}\nnot json\n')
    assert f"{f}:2" in str(pytest.raises(GraphError, read_bench, f, 10, None).value)
    # --bench-format names the format: a record without its keys is refused, naming them
    f.write_text('{"prompt": "hi"}\n')
    msg = str(pytest.raises(GraphError, read_bench, f, 10, "gsm8k").value)
    assert f"{f}:1" in msg and "'answer', 'question'" in msg


def test_the_cli_refuses_a_bad_bench_file_with_its_location(in_repo, tmp_path, capsys, monkeypatch):
    _no_models(monkeypatch)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Say the words: owl."}\n{"turn": "x"}\n')
    ck = tmp_path / "run"
    ck.mkdir()
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(ck), "--bench", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "keys found: turn" in err and "Traceback" not in err
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(ck), "--bench", str(tmp_path / "none.jsonl")]) == 2
    assert "--bench" in capsys.readouterr().err


def _no_models(monkeypatch):
    """Building a model fails the test: these refusals come before anything is loaded."""
    from dflash_graph.train import trained

    def built(*a, **k):
        raise AssertionError("eval built a model before refusing")

    monkeypatch.setattr(trained.Trained, "__init__", built)


def test_a_graph_that_differs_from_the_runs_is_refused_naming_each_difference(in_repo, tmp_path, capsys, monkeypatch):
    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train import rundir

    _no_models(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    spec = compile_graph("graphs/tiny.toml", rewrite=False).typed.ctx.spec
    rundir.record(run, spec, ["dflash-graph", "run", "graphs/tiny.toml"], [], 3)
    rec = json.loads((run / "run.json").read_text())        # a run that hooked other layers than the graph does
    rec["resolved"]["models"]["drafter"]["config"]["target_layer_ids"] = [1, 4]
    (run / "run.json").write_text(json.dumps(rec))
    code = main(["eval", "graphs/tiny.toml", "--checkpoint", str(run), "--set", "dims.block=8"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "models.drafter.config.block_size is 8 (written 'block') in this graph, 4 in the run" in err
    assert "models.drafter.config.target_layer_ids is [1, 3] in this graph, [1, 4] in the run" in err
    assert err.count("error at models.drafter.config.") == 2 and "graphs/tiny.toml:" in err


@pytest.mark.parametrize("flags, says", [
    (["--prompts", "0"], "--prompts 0: error: must be at least 1"),
    (["--device", "cuda"], "--device cuda: error:"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: error: must be at least 1"),
    (["--bench-format", "gsm8k"], "--bench-format gsm8k: error: --bench-format applies to --bench files"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, says, tmp_path, capsys):
    import torch

    if flags[0] == "--device" and torch.cuda.is_available():
        flags = ["--device", f"cuda:{torch.cuda.device_count()}"]
        says = f"--device {flags[1]}: error:"
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_27b_target_is_refused_before_it_is_built(in_repo, tmp_path, capsys, monkeypatch):
    _no_models(monkeypatch)
    code = main(["eval", "graphs/qwen27b.toml", "--checkpoint", str(tmp_path), "--prompts", "1",
                 "--host-memory", "32GiB"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    # 26,895,998,464 target parameters and 1,730,213,120 - shared drafter parameters, bf16
    assert "eval would need at least" in err and "on cpu" in err and "has 32.00 GiB (--host-memory)" in err
    assert "target weights 50.10 GiB" in err and "nothing was loaded" in err


def test_the_held_out_tau_training_predicted_is_the_last_in_metrics(tmp_path):
    assert heldout_tau(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "tau": 1.0}, {"step": 2, "heldout": {"tau": 1.25, "loss": 3.0}}, {"step": 3, "tau": 1.1},
        {"step": 4, "heldout": {"tau": 1.5, "loss": 2.0}}, {"step": 5}]) + "\n")
    assert heldout_tau(tmp_path) == {"tau": 1.5, "step": 4}
    ck = tmp_path / "checkpoints" / "step-5"
    ck.mkdir(parents=True)
    assert heldout_tau(ck)["tau"] == 1.5                       # --checkpoint naming one checkpoint of the run


def test_the_serving_commands_in_the_docs_are_the_ones_serve_check_runs():
    import shlex
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from serve_check import ENGINES, commands, why_not

    page = (REPO / "docs" / "drafter.md").read_text()
    for engine in ENGINES:
        for cmd in commands(engine, "TARGET_DIR", "HF_DIR", "PROMPTS.jsonl", 16, 128):
            assert shlex.join(cmd) in page, shlex.join(cmd)
        if why_not(engine) is not None:          # absent here: said why, not an error
            assert engine in why_not(engine) or "GPU" in why_not(engine)


def test_a_checkpoint_of_other_shapes_is_refused_naming_each_tensor():
    import torch

    from dflash_graph.train.trained import mismatches

    m = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2))
    state = {"0.weight": torch.zeros(3, 8), "1.weight": torch.zeros(2, 3), "2.weight": torch.zeros(1)}
    assert mismatches(m, state) == ("0.weight: checkpoint [3, 8], graph [3, 4]; 2.weight: only in the checkpoint; "
                                    "1.bias: not in the checkpoint")


def _evaluator(plan, store, free, monkeypatch):
    """What train/heldout.py's evaluator (rank 0, t0) decides before it builds anything, `free` bytes free."""
    from types import SimpleNamespace

    from dflash_graph.train import heldout

    monkeypatch.setattr(heldout, "free_bytes", lambda device, fresh=False: (free, "this host's MemAvailable"))
    t = SimpleNamespace(plan=plan, tdev={"t0": "cpu", "t1": "cpu", "draft": "cpu:0"}, eval_device="t0", store=store,
                        rank=0, writer=2, fsdp=False, opts=SimpleNamespace(out=Path("runs/tiny-torchrun")),
                        _seq_len=lambda: _seq(plan))
    return heldout._verdict(t, 100)


def _seq(plan) -> int:
    return next(ty.sizes[0] for r, ty in plan.typed.types.items() if r.node == "tokens" and r.output == "input_ids")


def test_the_evaluator_under_torchrun_skips_what_does_not_fit_beside_its_target(in_repo, monkeypatch):
    """The rank that evaluates beside its target replica asks for the lm_head its replica dropped, counts the
    drafter's own weights, that lm_head and the logits (eval's figures), and when they exceed what its device has
    free, skips naming the rank, the device, both figures and `eval`. (That a replica whose device reads no logits
    drops its lm_head, and that the writer then sends it, tests/test_distributed.py runs under torchrun.)"""
    from types import SimpleNamespace

    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.heldout import eval_need
    from dflash_graph.units import fmt_bytes

    plan = compile_graph("graphs/tiny.toml", ["devices.draft.torch=cpu:0"])
    dropped = SimpleNamespace(full=lambda model, tdev: SimpleNamespace(lm_head=None))
    need = eval_need(plan, "drafter", "target", _seq(plan))
    dims = plan.typed.ctx.models["target"].dims
    head = dims.vocab_size * dims.hidden_size * 4                # float32
    total = need["drafter weights"] + head + need["logits"]
    assert _evaluator(plan, dropped, total, monkeypatch) == {"wants_head": True, "skip": None}
    v = _evaluator(plan, dropped, total - 1, monkeypatch)
    assert v["wants_head"] is True
    assert v["skip"].startswith(f"the held-out evaluation of step 100 would need at least {fmt_bytes(total)} on "
                                f"rank 0 (t0, cpu) beside its target (drafter weights "), v["skip"]
    assert f", lm_head {fmt_bytes(head)}, logits " in v["skip"] and "(this host's MemAvailable)" in v["skip"]
    assert v["skip"].endswith("not evaluated: dflash-graph eval GRAPH --checkpoint runs/tiny-torchrun measures tau "
                              "from the checkpoint")
    kept = SimpleNamespace(full=lambda model, tdev: SimpleNamespace(lm_head=object()))
    assert _evaluator(plan, kept, total - head, monkeypatch) == {"wants_head": False, "skip": None}


@pytest.mark.slow     # 22-63 s on the shared 2-core machine, with its load
def test_a_run_launched_under_torchrun_gets_its_held_out_evaluation(in_repo, tmp_path):
    """`dflash-graph launch` runs the held-out evaluation inside the job (train/heldout.py), on the target rank of
    replica 0: the same figures as the run in one process reports at its last step (the drafters agree to float
    rounding), printed, recorded in metrics.jsonl and in the summary, and read by eval as what training predicted."""
    import sys

    from test_distributed import session

    one, dist = tmp_path / "one", tmp_path / "dist"
    assert main(["run", "graphs/tiny.toml", "--steps", "2", "--out", str(one), "--no-progress"]) == 0
    with session([sys.executable, "-m", "dflash_graph", "launch", "--standalone", "--nproc-per-node", "3", "run",
                  "graphs/tiny.toml", "--steps", "2", "--out", str(dist), "--no-progress"]) as p:
        out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    a = [json.loads(x) for x in open(one / "metrics.jsonl")][-1]["heldout"]
    b = [json.loads(x) for x in open(dist / "metrics.jsonl")][-1]["heldout"]
    assert out.count("held-out @ step 2: loss") == 1 and "not measured" not in out, out
    assert f"held-out tau: {b['tau']} (step 2, {b['anchors']} anchors)" in out, out
    assert set(a) == set(b) and a["anchors"] == b["anchors"] and a["sequences"] == b["sequences"]
    assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]) and abs(a["tau"] - b["tau"]) <= 0.01
    assert heldout_tau(dist) == {"tau": b["tau"], "step": 2}


def test_graph_keys_compare_by_value_not_by_how_they_are_written():
    from dflash_graph.cli.evaluate import _resolve

    flat = {"dims.vocab": "target.vocab_size", "models.target.config.vocab_size": 768, "dims.block": 4,
            "dims.tokens": "anchors * block", "dims.anchors": 16}
    assert [_resolve(flat, v) for v in ("vocab - 1", "block", "tokens", 7)] == [767, 4, 64, 7]
    assert _resolve(flat, "silu") == "silu" and _resolve(flat, "block // 0") == "block // 0"


# ------------------------------------------------------------------------------------------ multi-turn decoding
class Asked(Chat):
    """A Chat that records each prompt asked: (the answers it was asked after, the conversation)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked: list[tuple[list[list[int]], list[dict]]] = []

    def ids(self, answers=()):
        self.asked.append(([list(a) for a in answers], self.conversation(answers)))
        return super().ids(answers)


class _Scripted:
    """A decoder of scripted outputs (no model): each call returns its side's next output; measure's bookkeeping
    is what is under test."""

    def __init__(self, spec_out, target_out):
        import torch

        self.head = torch.nn.Linear(1, 1)
        self.block, self.forwards, self.prefill_seconds = 4, 0, 0.0
        self.spec_out, self.target_out = list(spec_out), list(target_out)

    def speculative(self, prompt, max_new, sampling, gen):
        self.forwards = 2
        return self.spec_out.pop(0), [1]

    def target_only(self, prompt, max_new, sampling, gen):
        self.forwards = 3
        return self.target_out.pop(0)


def test_a_greedy_divergence_is_reported_and_each_side_goes_on_with_its_own_answer(tok):
    from dflash_graph.train.speculative import measure

    _, dialogues = read_bench(BENCH / "mtbench.jsonl", 2)
    asked = [Asked(tok, d) for d in dialogues]
    five, six, seven = (tok(w, add_special_tokens=False)["input_ids"] for w in ("five", "six", "seven"))
    # prompt 1: both sides agree on both turns; prompt 2: they differ at turn 1, then give the same text at turn 2
    dec = _Scripted([five, five, six, seven], [five, five, seven, seven])
    res = measure(dec, asked, 8)
    assert res["divergences"] == [{"prompt": 1, "turn": 1}] and res["lossless"] is False
    assert (res["turns"], res["identical_to_greedy"]) == (4, 2) and res["lossless_per_prompt"] == [True, False]
    (_, _), (_, _), (a2, c2), (b2, d2) = asked[1].asked
    assert a2 == [six] and b2 == [seven] and c2[1]["content"] == "six" and d2[1]["content"] == "seven"
    from dflash_graph.cli.evaluate import _row, render_table

    table = render_table([_row("mtbench", "mtbench", None, res)], None)
    assert "\nmtbench    2        4      " in table and table.split("\n")[2].split()[-1] == "2/4"
    assert "mtbench: prompt 1 (from 0) turn 1: greedy speculative decoding differed from target-only" in table
    # sampled: no per-turn comparison, each side always asks after its own answer
    asked = [Asked(tok, dialogues[0])]
    res = measure(_Scripted([five, five], [six, six]), asked, 8, temperature=0.7)
    assert res["divergences"] == [] and res["identical_to_greedy"] is None and res["turns"] == 2
    assert asked[0].asked[2][1][1]["content"] == "five" and asked[0].asked[3][1][1]["content"] == "six"


# ------------------------------------------------------------------------------------ chat template variables
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


def test_a_chat_template_variable_reaches_the_template_the_way_qwen3s_switch_does(tok):
    from copy import deepcopy

    from dflash_graph.train.bench import template_kwargs_problems, template_variables

    assert "enable_thinking" in template_variables(QWEN3_LIKE)
    qwen = deepcopy(tok)
    qwen.chat_template = QWEN3_LIKE
    _, dialogues = read_bench(BENCH / "math500.jsonl", 1)
    flags = {"enable_thinking": "--no-thinking"}
    assert template_kwargs_problems(qwen, {"enable_thinking": False}, flags, "t") == []
    off = chats(qwen, dialogues, "f", {"enable_thinking": False})[0].text()
    on = chats(qwen, dialogues, "f")[0].text()
    assert off == on + "<think>\n\n</think>\n\n"
    # tiny's template has no such switch: transformers would pass it and Jinja ignore it, so it is refused
    (p,) = template_kwargs_problems(tok, {"enable_thinking": False}, flags, "tiny/chat_template.jinja")
    assert p.loc.flag == "--no-thinking" and "does not read 'enable_thinking'" in p.message
    assert "tiny/chat_template.jinja" in p.message and "add_generation_prompt" in p.expected
    (p,) = template_kwargs_problems(qwen, {"add_generation_prompt": False}, {"add_generation_prompt": "--x"}, "t")
    assert "passed to the chat template by transformers itself" in p.message


@pytest.mark.parametrize("flags, says", [
    (["--no-thinking"], "--no-thinking: error: the target's chat template (tiny/chat_template.jinja, beside [data] "
                        "tokenizer) does not read 'enable_thinking'"),
    (["--chat-template-kwarg", "enable_thinking"], "--chat-template-kwarg enable_thinking: error: not KEY=VALUE"),
    (["--chat-template-kwarg", "x=1", "--chat-template-kwarg", "x=2"], "error: x is given twice"),
])
def test_a_chat_template_flag_the_template_cannot_take_exits_2(flags, says, in_repo, tmp_path, capsys, monkeypatch):
    _no_models(monkeypatch)
    ck = tmp_path / "run"
    ck.mkdir()
    code = main(["eval", "graphs/tiny.toml", "--checkpoint", str(ck), "--bench", str(BENCH / "mtbench.jsonl"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    # without --bench there is no template to render: refused too
    assert main(["eval", "graphs/tiny.toml", "--checkpoint", str(ck), "--no-thinking"]) == 2
    assert "--no-thinking: error: chat template values apply to --bench prompts" in capsys.readouterr().err
