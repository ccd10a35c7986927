"""Every input gets an answer: `check` on mutated copies of the shipped graphs (and hostile `--set` flags) exits
0 or 1 for a valid graph and 2 with a located message otherwise, never 3 ("internal error"), never a traceback,
and never hangs.

Mutations: values replaced by hostile ones (zero, negative, huge, nan, inf, unicode, long strings, deep nesting,
expressions that divide by zero or explode), keys and lines deleted, duplicated or swapped (duplicated ids,
cycles), truncation, junk bytes, many nodes; and `--set` flags on real and misspelt paths.
200 examples in the default run, 5,000 under `--hypothesis-profile=thorough` (HYPOTHESIS_PROFILE=thorough).
`python tests/test_check_fuzz.py [N]` runs N seeded examples and prints the count of each outcome."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from dflash_graph.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
BASES = {
    "minimal": ROOT / "tests/graphs/minimal.toml",
    "verifier_path": ROOT / "tests/graphs/verifier_path.toml",
    "tiny": ROOT / "graphs/tiny.toml",
    "qwen27b": ROOT / "graphs/qwen27b.toml",
    "gpu_check": ROOT / "graphs/gpu_check.toml",
}
TEXTS = {k: p.read_text() for k, p in BASES.items()}
HANG_SECONDS = 60     # a hang detector, not a performance claim (benchmarks/check_scaling.py measures time)
OUTCOMES: Counter = Counter()
LAST = {"message": ""}

HOSTILE = [
    "0", "-1", "-3", "1", "2", "3", "64", "1.5", "0.0", "-0.0", "1e30", "1e-30", str(2**31), str(2**64), str(10**12),
    "1" * 5000, "nan", "-nan", "inf", "-inf", "true", "false", '""', '" "', '"x"', '"cpu"', '"cuda:\u00b2"', '"cuda:99"',
    '"meta"', '"\u00e9\u4e2d\U0001f600"', '"\\u0000"', '"a.b"', '"a.b.c"', '"nope.out"', '"tokens.input_ids"',
    '"9 ** 9 ** 9"', '"256 % (block - 4)"', '"seq // 0"', '"seq ** -1"', '"seq - seq"', '"target.nothing"',
    '"' + " + ".join(["1"] * 3000) + '"', '"' + "(" * 300 + "1" + ")" * 300 + '"', '"' + "x" * 40000 + '"',
    "[" * 600 + "]" * 600, "[]", "{}", "[1, 99]", "[-1]", '["a", 1]', "{ embed = 1 }", '{ embed = "drafter.embed" }',
    '"9999999999999999999999999999 GiB"', '"-1 GiB"', '"1 PiB"', '"1e400 GiB"', "1979-05-27T07:32:00Z",
]
SET_KEYS = [
    "dims.seq", "dims.seqq", "dims.", ".seq", "dims..seq", "dims.hidden", "dims.block", "dims.anchors",
    "train.lr", "train.steps", "train.betas", "train.seed", "train.grad_accum", "train.nope",
    "memory.max_split_size", "memory.expandable_segments", "devices.a.capacity", "devices.t0.capacity",
    "devices.gpu0.torch", "devices.nope.torch", "models.target.config.hidden_size", "models.target.config.hidden_siz",
    "models.target.config.num_hidden_layers", "models.drafter.config.target_layer_ids", "models.drafter.shares.embed",
    "nodes.loss.params.gamma", "nodes.tokens.params.length", "nodes.hidden_tx.params.queue", "nodes.nope.device",
    "nodes.body.device", "nodes.loss", "graph.name", "nope", "models.target.dtype", "data.corpus",
]


@contextlib.contextmanager
def hang_guard(seconds: int, seed: int | None = None):
    class Hang(BaseException):   # not an Exception: main() must not turn it into an exit code
        pass

    def on_alarm(signum, frame):
        raise Hang(f"seed {seed}: check did not answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def mutate(text: str, rnd: random.Random) -> str:
    lines = text.split("\n")
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        kind = rnd.choice(["value"] * 6 + ["delete", "duplicate", "swap", "truncate", "junk", "nodes", "rename",
                                           "reref", "reref"])
        i = rnd.randrange(len(lines)) if lines else 0
        if kind == "value":
            assigns = [j for j, ln in enumerate(lines) if re.match(r"\s*[A-Za-z0-9_\-\"]+\s*=", ln)]
            if assigns:
                j = rnd.choice(assigns)
                key, _, rest = lines[j].partition("=")
                if rest.strip().startswith("{") and rnd.random() < 0.6:   # one entry of an inline table
                    entries = rest.strip()[1:-1].split(",")
                    k = rnd.randrange(len(entries))
                    ek, _, _ = entries[k].partition("=")
                    entries[k] = f"{ek}= {rnd.choice(HOSTILE)}"
                    lines[j] = f"{key}= {{{','.join(entries)} }}"
                else:
                    lines[j] = f"{key}= {rnd.choice(HOSTILE)}"
        elif kind == "delete" and lines:
            del lines[i]
        elif kind == "duplicate" and lines:
            lines.insert(i, lines[i])
        elif kind == "swap" and len(lines) > 1:
            j = rnd.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "truncate":
            return "\n".join(lines)[: rnd.randrange(len(text) + 1)]
        elif kind == "junk":
            junk = "".join(chr(rnd.choice([0, 1, 0x7f, 0xe9, 0x4e2d, 0xfeff, 0x1f600, 10, 34, 39, 91, 93, 123]))
                           for _ in range(rnd.randint(1, 8)))
            lines.insert(i, junk) if rnd.random() < 0.5 else lines.__setitem__(i, lines[i][: len(lines[i]) // 2] + junk)
        elif kind == "nodes":   # many nodes: a node block repeated, with fresh or duplicated ids
            starts = [j for j, ln in enumerate(lines) if ln.strip() == "[[nodes]]"]
            if starts:
                s = rnd.choice(starts)
                e = next((j for j in range(s + 1, len(lines)) if lines[j].startswith("[")), len(lines))
                block = lines[s:e]
                fresh = rnd.random() < 0.7
                for c in range(rnd.choice([2, 50, 400])):
                    lines += [re.sub(r'^id = "([^"]+)"', rf'id = "\1_{c}"', ln) if fresh else ln for ln in block]
        elif kind == "rename":  # an id changed: readers dangle
            ids = [j for j, ln in enumerate(lines) if ln.startswith("id = ")]
            if ids:
                j = rnd.choice(ids)
                lines[j] = f'id = "{rnd.choice(["x", "tokens", "body", "a b", "", "loss"])}"'
        elif kind == "reref":   # an input pointed at another node's output: cycles, wrong shapes and dtypes
            refs = [j for j, ln in enumerate(lines) if ln.startswith("inputs = {")]
            ids = re.findall(r'^id = "([^"]+)"', text, flags=re.M)
            if refs and ids:
                j = rnd.choice(refs)
                lines[j] = re.sub(r'"[A-Za-z0-9_\-]+\.', f'"{rnd.choice(ids)}.', lines[j], count=1)
    return "\n".join(lines)


def flags(rnd: random.Random) -> list[str]:
    out = []
    for _ in range(rnd.choice([0, 0, 0, 1, 1, 2])):
        out += ["--set", f"{rnd.choice(SET_KEYS)}={rnd.choice(HOSTILE)[:20000]}"]
    return out


def check_once(workdir: Path, seed: int) -> str:
    rnd = random.Random(seed)
    base = rnd.choice(list(TEXTS))
    text = mutate(TEXTS[base], rnd)
    path = workdir / "a" / "b" / f"{base}.toml"
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    argv = ["check", str(path), *flags(rnd)]
    if rnd.random() < 0.1:
        argv.append("--no-rewrite")
    out, err = io.StringIO(), io.StringIO()
    with hang_guard(HANG_SECONDS, seed), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    msg = LAST["message"] = err.getvalue()
    assert code in (0, 1, 2), f"seed {seed}: exit {code}\n{msg}\nargv: {argv[:3]}"
    assert "Traceback" not in msg and "internal error" not in msg, f"seed {seed}: {msg}"
    if code == 2:
        assert msg.strip(), f"seed {seed}: exit 2 without a message"
        assert msg.startswith(str(path)) or msg.startswith("error:"), f"seed {seed}: message names no file:\n{msg}"
    return {0: "fits", 1: "predicted OOM", 2: "refused (exit 2)"}[code]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "a" / "b").mkdir(parents=True)
    (d / "graphs").symlink_to(ROOT / "graphs")                 # verifier_path's "../../graphs/tiny/config.json"
    for sub in ("tiny", "qwen27b"):
        (d / "a" / "b" / sub).symlink_to(ROOT / "graphs" / sub)   # the shipped graphs' relative paths
    return d


PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")


@settings(max_examples=5000 if PROFILE == "thorough" else 200)
@given(seed=st.integers(0, 2**32 - 1))
def test_check_answers_every_mutated_graph(workdir, seed):
    OUTCOMES[check_once(workdir, seed)] += 1


def test_shipped_graphs_still_check(workdir):
    """The fuzz bases are valid: an unmutated graph is never refused."""
    for base, p in BASES.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", str(p)])
        assert code in (0, 1), (base, err.getvalue())


if __name__ == "__main__":
    import tempfile
    import time

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "a" / "b").mkdir(parents=True)
        (d / "graphs").symlink_to(ROOT / "graphs")
        for sub in ("tiny", "qwen27b"):
            (d / "a" / "b" / sub).symlink_to(ROOT / "graphs" / sub)
        slowest = (0.0, None)
        kinds: Counter = Counter()
        t_all = time.perf_counter()
        for seed in range(n):
            t = time.perf_counter()
            try:
                OUTCOMES[check_once(d, seed)] += 1
            except (AssertionError, BaseException) as e:   # a Hang is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                OUTCOMES["FAILED" if isinstance(e, AssertionError) else "HANG"] += 1
                print(e)
            dt = time.perf_counter() - t
            slowest = max(slowest, (dt, seed))
            first = LAST["message"].split("\n", 1)[0].partition(": error")[2] or "(no error)"
            kinds[re.sub(r"'[^']*'|\d+", "_", first.split(":", 1)[-1])[:80]] += 1
        print(f"{n} mutated graphs in {time.perf_counter() - t_all:.0f} s:", dict(OUTCOMES),
              f"slowest: {slowest[0]:.2f} s (seed {slowest[1]})")
        print(f"{len(kinds)} distinct first errors; the most common:")
        for k, v in kinds.most_common(25):
            print(f"{v:6d}  {k}")
