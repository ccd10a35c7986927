"""Benchmark prompt files for `dflash-graph eval --bench FILE`: local JSONL in each benchmark's published record
format, turned into the conversations the target answers, then into token ids through the target's chat template.

The formats, detected from a record's keys (first match; `--bench-format NAME` names one instead):

| format     | keys read                                   | the user turn                                          |
|------------|---------------------------------------------|--------------------------------------------------------|
| `mtbench`  | `turns` (list of str; `question_id`, ...)   | the FIRST turn only (a one-turn prompt; see below)      |
| `humaneval`| `task_id`, `prompt` (`entry_point`, ...)    | "Complete this Python function:" and the `prompt` code  |
| `mbpp`     | `text`, `test_list` (`code`, `task_id`)     | the `text` task and the tests its code must pass        |
| `math500`  | `problem` (`solution`, `answer`)            | the `problem`                                          |
| `gsm8k`    | `question`, `answer`                        | the `question`                                         |
| `messages` | `messages` (list of {role, content})        | the conversation up to its last user message           |
| `prompt`   | `prompt` (str)                              | the `prompt`                                           |

MT-Bench: only the first turn of each question is decoded. Its second turn needs the first turn's answer, and
decoding turn 2 after the target's own answer would make every benchmark row depend on the generated length of
another prompt; one turn per question keeps the rows comparable to the single-turn benchmarks.

The reference answers (`answer`, `solution`, `code`, `canonical_solution`) are never put in the prompt: the decoder
writes the answer, as a served model would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GraphError, Location, Problem

Conversation = list[dict[str, str]]


def _mtbench(rec: Mapping[str, Any]) -> Conversation:
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise ValueError("'turns' must be a non-empty list of strings")
    return [{"role": "user", "content": turns[0]}]


def _humaneval(rec: Mapping[str, Any]) -> Conversation:
    return [{"role": "user", "content": "Complete this Python function:\n\n" + _text(rec, "prompt")}]


def _mbpp(rec: Mapping[str, Any]) -> Conversation:
    tests = rec["test_list"]
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("'test_list' must be a list of strings")
    body = _text(rec, "text") + ("\nYour code should pass these tests:\n" + "\n".join(tests) if tests else "")
    return [{"role": "user", "content": body}]


def _messages(rec: Mapping[str, Any]) -> Conversation:
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError("'messages' must be a list of {\"role\": str, \"content\": str}")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("'messages' has no user message to answer")
    return [{"role": m["role"], "content": m["content"]} for m in msgs[: last_user + 1]]


def _text(rec: Mapping[str, Any], key: str) -> str:
    v = rec[key]
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"'{key}' must be a non-empty string")
    return v


def _field(key: str) -> Callable[[Mapping[str, Any]], Conversation]:
    return lambda rec: [{"role": "user", "content": _text(rec, key)}]


@dataclass(frozen=True)
class Format:
    name: str
    keys: frozenset[str]                                   # all present: the record is of this format
    conversation: Callable[[Mapping[str, Any]], Conversation]


# in detection order: the more specific key sets first (HumanEval's records also have a `prompt`)
FORMATS: tuple[Format, ...] = (
    Format("mtbench", frozenset({"turns"}), _mtbench),
    Format("humaneval", frozenset({"task_id", "prompt"}), _humaneval),
    Format("mbpp", frozenset({"text", "test_list"}), _mbpp),
    Format("math500", frozenset({"problem"}), _field("problem")),
    Format("gsm8k", frozenset({"question", "answer"}), _field("question")),
    Format("messages", frozenset({"messages"}), _messages),
    Format("prompt", frozenset({"prompt"}), _field("prompt")),
)
BY_NAME = {f.name: f for f in FORMATS}


def detect(rec: Mapping[str, Any]) -> Format | None:
    return next((f for f in FORMATS if f.keys <= rec.keys()), None)



def read_bench(path: Path, count: int, fmt: str | None = None) -> tuple[str, list[Conversation]]:
    """(format name, the first `count` conversations) of a benchmark file; a GraphError naming the file, the line
    and what is wrong (the keys found, for a record of no known format)."""
    if not path.is_file():
        raise GraphError(Problem("no such file" if not path.exists() else "not a file",
                                 Location(flag=f"--bench {path}"),
                                 hint="--bench takes a local JSONL file (nothing is downloaded)"))
    form = BY_NAME[fmt] if fmt else None
    out: list[Conversation] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if len(out) >= count:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise GraphError(Problem(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                                         Location(str(path), lineno),
                                         hint="a benchmark file is UTF-8 JSONL, one JSON object a line")) from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise GraphError(Problem(f"not valid JSON ({e.msg} at column {e.colno})", Location(str(path), lineno),
                                         hint="each line must be one JSON object")) from None
            if not isinstance(rec, dict):
                raise GraphError(Problem(f"a JSON {type(rec).__name__}, not an object", Location(str(path), lineno),
                                         hint="each line must be one JSON object"))
            this = form or detect(rec)
            if this is None:
                raise GraphError(Problem(
                    f"a record of no known benchmark format (keys found: {', '.join(sorted(rec)) or 'none'})",
                    Location(str(path), lineno),
                    expected="; ".join(f"{f.name}: {', '.join(sorted(f.keys))}" for f in FORMATS),
                    actual=", ".join(sorted(rec)) or "{}",
                    hint="give each record the keys of its benchmark's published format, or name the format "
                         f"with --bench-format ({' | '.join(BY_NAME)})"))
            form = form or this           # one file, one format: the first record's
            missing = sorted(form.keys - rec.keys())
            if missing:
                raise GraphError(Problem(f"a {form.name} record without {', '.join(repr(k) for k in missing)} "
                                         f"(keys found: {', '.join(sorted(rec)) or 'none'})",
                                         Location(str(path), lineno),
                                         hint=f"every record of a {form.name} file has "
                                              f"{', '.join(sorted(form.keys))}"))
            try:
                out.append(form.conversation(rec))
            except ValueError as e:
                raise GraphError(Problem(f"a {form.name} record that cannot be read: {e}",
                                         Location(str(path), lineno))) from None
    if not out:
        raise GraphError(Problem("the benchmark file has no records", Location(str(path)),
                                 hint="one JSON object a line"))
    return (form.name if form else "?"), out


def prompt_ids(tok, conversations: Sequence[Conversation], file: str) -> list[list[int]]:
    """Each conversation rendered by the target's chat template with the generation prompt (what a chat server
    sends the model), as token ids."""
    if not getattr(tok, "chat_template", None):
        raise GraphError(Problem("the target's tokenizer has no chat template, so benchmark prompts cannot be "
                                 "rendered as the target sees them", Location(file),
                                 hint="set [data] chat_template, or put a chat_template.jinja beside the tokenizer"))
    out = []
    for conv in conversations:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def bench_name(path: Path, taken: set[str]) -> str:
    """A row's name: the file's stem, made unique among the files of one call."""
    name, k = path.stem, 2
    while name in taken:
        name, k = f"{path.stem}-{k}", k + 1
    taken.add(name)
    return name


def heldout_tau(run_dir: Path) -> dict[str, Any] | None:
    """What training predicted: the last held-out evaluation in the run's metrics.jsonl ({"tau", "step"}), or None
    when the run has none (no [data] holdout, or no eval_every step yet)."""
    for d in (run_dir, run_dir.parent, run_dir.parent.parent):
        f = d / "metrics.jsonl"
        if f.is_file():
            last = None
            try:
                lines = f.read_text().splitlines()
            except OSError:
                return None
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                ev = rec.get("heldout") if isinstance(rec, dict) else None
                if isinstance(ev, dict) and ev.get("tau") is not None:
                    last = {"tau": ev["tau"], "step": rec.get("step")}
            return last
    return None
