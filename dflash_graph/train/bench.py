"""Benchmark prompt files for `dflash-graph eval --bench FILE`: local JSONL in each benchmark's published record
format, turned into the dialogues the target answers, then into token ids through the target's chat template.

The formats, detected from a record's keys (first match; `--bench-format NAME` names one instead):

| format     | keys read                                   | the user turns asked                                   |
|------------|---------------------------------------------|--------------------------------------------------------|
| `mtbench`  | `turns` (list of str; `question_id`, ...)   | every turn, each after the answer decoded for the last |
| `humaneval`| `task_id`, `prompt` (`entry_point`, ...)    | "Complete this Python function:" and the `prompt` code  |
| `mbpp`     | `text`, `test_list` (`code`, `task_id`)     | the `text` task and the tests its code must pass        |
| `math500`  | `problem` (`solution`, `answer`)            | the `problem`                                          |
| `gsm8k`    | `question`, `answer`                        | the `question`                                         |
| `messages` | `messages` (list of {role, content})        | its last user message, after the messages before it    |
| `prompt`   | `prompt` (str)                              | the `prompt`                                           |

NOTE [Multi-turn]: MT-Bench is asked as FastChat's `fastchat/llm_judge/gen_model_answer.py` (`get_model_answers`)
asks it: for each turn, the user turn is appended to the conversation, the chat template renders it with the
generation prompt, the model generates, and its answer (decoded to text, special tokens removed, stripped) is put in
the conversation as the assistant turn before the next user turn. Each side of eval (speculative and target-only)
asks turn 2 after the answer it decoded itself for turn 1 (`Chat.ids`); train/speculative.py's `measure` does the
turns in order and compares the two sides' prompts. A `messages` record is a conversation someone wrote, assistant
answers included: it is asked once, after its last user message, with its own assistant messages as the history
(the answers the record's author chose to condition on; decoding each of its user turns would throw those answers
away). A conversation the model answers turn by turn is written in the `turns` (MT-Bench) format.

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


@dataclass(frozen=True)
class Dialogue:
    """What one record asks: the messages before its first asked turn (`history`: a system message, a `messages`
    record's earlier turns), then each user turn of `turns` in order, each after the answer to the one before."""
    history: tuple[tuple[str, str], ...]            # (role, content)
    turns: tuple[str, ...]

    def conversation(self, answers: Sequence[str]) -> Conversation:
        """The messages of turn len(answers) + 1: the history, each earlier user turn followed by the answer decoded
        for it as the assistant message, then this turn's user message (NOTE [Multi-turn])."""
        if len(answers) >= len(self.turns):
            raise IndexError(f"{len(answers)} answers for a dialogue of {len(self.turns)} turn(s)")
        out = [{"role": r, "content": c} for r, c in self.history]
        for q, a in zip(self.turns, answers):
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"role": "user", "content": self.turns[len(answers)]})
        return out


def _ask(text: str) -> Dialogue:
    return Dialogue((), (text,))


def _mtbench(rec: Mapping[str, Any]) -> Dialogue:
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("'turns' must be a non-empty list of non-empty strings")
    return Dialogue((), tuple(turns))


def _humaneval(rec: Mapping[str, Any]) -> Dialogue:
    return _ask("Complete this Python function:\n\n" + _text(rec, "prompt"))


def _mbpp(rec: Mapping[str, Any]) -> Dialogue:
    tests = rec["test_list"]
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("'test_list' must be a list of strings")
    return _ask(_text(rec, "text") + ("\nYour code should pass these tests:\n" + "\n".join(tests) if tests else ""))


def _messages(rec: Mapping[str, Any]) -> Dialogue:
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError("'messages' must be a list of {\"role\": str, \"content\": str}")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("'messages' has no user message to answer")
    # asked once, after its last user message: its own assistant messages are history (NOTE [Multi-turn])
    return Dialogue(tuple((m["role"], m["content"]) for m in msgs[:last_user]), (msgs[last_user]["content"],))


def _text(rec: Mapping[str, Any], key: str) -> str:
    v = rec[key]
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"'{key}' must be a non-empty string")
    return v


def _field(key: str) -> Callable[[Mapping[str, Any]], Dialogue]:
    return lambda rec: _ask(_text(rec, key))


@dataclass(frozen=True)
class Format:
    name: str
    keys: frozenset[str]                                   # all present: the record is of this format
    dialogue: Callable[[Mapping[str, Any]], Dialogue]


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



def read_bench(path: Path, count: int, fmt: str | None = None) -> tuple[str, list[Dialogue]]:
    """(format name, the first `count` dialogues) of a benchmark file; a GraphError naming the file, the line
    and what is wrong (the keys found, for a record of no known format)."""
    if not path.is_file():
        raise GraphError(Problem("no such file" if not path.exists() else "not a file",
                                 Location(flag=f"--bench {path}"),
                                 hint="--bench takes a local JSONL file (nothing is downloaded)"))
    form = BY_NAME[fmt] if fmt else None
    out: list[Dialogue] = []
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
                out.append(form.dialogue(rec))
            except ValueError as e:
                raise GraphError(Problem(f"a {form.name} record that cannot be read: {e}",
                                         Location(str(path), lineno))) from None
    if not out:
        raise GraphError(Problem("the benchmark file has no records", Location(str(path)),
                                 hint="one JSON object a line"))
    return (form.name if form else "?"), out


class Chat:
    """A dialogue as the decoders ask it, through the target's chat template: `ids(answers)` is the prompt of turn
    len(answers) + 1 given the token ids each side decoded for the earlier turns (NOTE [Multi-turn])."""

    def __init__(self, tok, dialogue: Dialogue, template_kwargs: Mapping[str, Any] | None = None):
        self.tok, self.dialogue, self.template_kwargs = tok, dialogue, dict(template_kwargs or {})

    @property
    def turns(self) -> int:
        return len(self.dialogue.turns)

    def answer(self, ids: Sequence[int]) -> str:
        """An answer as the next turn's history holds it: its text without special tokens (the end-of-sequence
        token that stopped it), stripped, as FastChat's gen_model_answer.py puts it back in the conversation."""
        return self.tok.decode(list(ids), skip_special_tokens=True).strip()

    def conversation(self, answers: Sequence[Sequence[int]] = ()) -> Conversation:
        return self.dialogue.conversation([self.answer(a) for a in answers])

    def text(self, answers: Sequence[Sequence[int]] = ()) -> str:
        """The conversation rendered by the chat template with the generation prompt (what a chat server sends the
        model), with the --chat-template-kwarg values."""
        return self.tok.apply_chat_template(self.conversation(answers), tokenize=False, add_generation_prompt=True,
                                            **self.template_kwargs)

    def ids(self, answers: Sequence[Sequence[int]] = ()) -> list[int]:
        return list(self.tok(self.text(answers), add_special_tokens=False)["input_ids"])

    def longest(self, max_new: int) -> int:
        """The longest prompt of the dialogue, estimated before decoding: the last turn's prompt with every earlier
        answer empty, plus `max_new` tokens for each earlier answer."""
        return len(self.ids([[]] * (self.turns - 1))) + (self.turns - 1) * max_new


def chats(tok, dialogues: Sequence[Dialogue], file: str,
          template_kwargs: Mapping[str, Any] | None = None) -> list[Chat]:
    """Each dialogue to be asked through the target's chat template (refused, naming the file, when the tokenizer
    has none)."""
    if not getattr(tok, "chat_template", None):
        raise GraphError(Problem("the target's tokenizer has no chat template, so benchmark prompts cannot be "
                                 "rendered as the target sees them", Location(file),
                                 hint="set [data] chat_template, or put a chat_template.jinja beside the tokenizer"))
    return [Chat(tok, d, template_kwargs) for d in dialogues]


def template_variables(template: str) -> set[str]:
    """The names a chat template reads from its context (jinja2.meta), parsed by the Jinja environment transformers
    renders it with (its `{% generation %}` tag included)."""
    from jinja2 import meta

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment
    except ImportError:          # the helper moved: a plain sandbox parses every template that does not use the tag
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return set(meta.find_undeclared_variables(env.parse(template)))


def template_kwargs_problems(tok, kwargs: Mapping[str, Any], flags: Mapping[str, str],
                             source: str) -> list[Problem]:
    """Each --chat-template-kwarg the target's chat template would not read, as a Problem at its flag.
    transformers passes apply_chat_template's extra keyword arguments to the template as variables, and Jinja
    ignores a variable the template never reads: `enable_thinking=false` given to a template without Qwen3's
    switch would change nothing, silently. A name apply_chat_template or the tokenizer already passes (`messages`,
    `add_generation_prompt`, `eos_token`, ...) is refused too. `flags`: each key's flag as written; `source`:
    where the template comes from, for the message."""
    import inspect

    from jinja2 import TemplateSyntaxError

    if not kwargs:
        return []
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):          # named templates: apply_chat_template renders "default" here
        template = template.get("default")
    if not isinstance(template, str):       # none: refused by `chats`
        return []
    try:
        reads = template_variables(template)
    except TemplateSyntaxError as e:
        return [Problem(f"the chat template cannot be parsed ({e.message}, its line {e.lineno})", Location(source),
                        hint="fix the template, or drop --chat-template-kwarg")]
    taken = ({n for n in inspect.signature(tok.apply_chat_template).parameters if n != "kwargs"}
             | {"messages"} | set(getattr(tok, "special_tokens_map", {})))
    out = []
    for key in kwargs:
        if key in taken:
            out.append(Problem(f"{key!r} is passed to the chat template by transformers itself",
                               Location(flag=flags[key]),
                               hint="--chat-template-kwarg sets the template's own switches (e.g. enable_thinking)"))
        elif key not in reads:
            own = sorted(reads - taken - {"raise_exception", "strftime_now", "range", "namespace"})
            out.append(Problem(f"the target's chat template ({source}) does not read {key!r}: it would be ignored",
                               Location(flag=flags[key]),
                               expected=f"a variable of the template's own: {', '.join(own)}" if own else
                               "none: the template reads only what transformers passes it "
                               f"({', '.join(sorted(reads & taken))})",
                               actual=key,
                               hint="drop the flag for this target (Qwen3's templates read enable_thinking; "
                                    "[data] chat_template names another template)"))
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
