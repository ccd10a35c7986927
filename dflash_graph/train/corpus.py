"""Reading a corpus into documents: token ids plus a loss mask (the tokens the drafter learns to predict).

Formats (`[data] format`, default `auto`):

* `text`: JSONL, one object per line with a text field (`text_key`); every token after the first is a loss token.
* `chat`: JSONL with `messages` (a list of `{role, content}`), rendered with the target tokenizer's own chat
  template; only the assistant's tokens are loss tokens (`render_chat`).
* `tokens`: pre-tokenized JSONL or Parquet, `input_ids` (a list of ints) and an optional `loss_mask` (0/1 or
  booleans, as long as `input_ids`; absent: every token after the first).
* `hf`: a local Hugging Face `datasets` directory (`save_to_disk`) or data files (JSON/JSONL, Parquet, CSV),
  read through `datasets` itself; each row is then a text, chat or tokens record.

`auto` takes `hf` for a directory, `tokens` for a `.parquet` file, and for JSONL looks at the first record:
`messages` is chat, `input_ids` is tokens, the text field is text. Every record of a corpus has that one kind.

Every bad record is a `GraphError` naming the file, the line (JSONL) or row (Parquet, datasets), and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import GraphError, Location, Problem

FORMATS = ("auto", "text", "chat", "tokens", "hf")
ROLES = ("system", "user", "assistant", "tool", "developer")


class Document:
    """One document: `ids` and `loss` (loss[t]: token t is a token the drafter is trained to predict)."""

    __slots__ = ("ids", "loss")

    def __init__(self, ids: list[int], loss: list[bool]):
        self.ids, self.loss = ids, loss

    def __len__(self) -> int:
        return len(self.ids)


def _err(msg: str, file: str, line: int | None = None, field: str | None = None, hint: str | None = None,
         row: int | None = None) -> GraphError:
    where = []
    if row is not None:
        where.append(f"row {row}")
    if field is not None:
        where.append(f"field '{field}'")
    return GraphError(Problem(msg, Location(file, line, ", ".join(where) or None), hint=hint))


# -- the tokenizer ---------------------------------------------------------------------------------------------
def load_tokenizer(path: Path, chat_template: Path | None = None):
    """The target's tokenizer, from local files only: a directory with a tokenizer_config.json goes through
    `AutoTokenizer.from_pretrained` (so its own chat template comes with it); a tokenizer.json (or a directory
    with only that) through `models.nn.target.load_tokenizer`. A chat template is then taken, first match:
    `chat_template` (`[data] chat_template`), the tokenizer's own, a `chat_template.jinja` beside the file."""
    from ..models.nn.target import _offline
    from ..models.nn.target import load_tokenizer as load_json

    _offline()
    try:
        if path.is_dir() and (path / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            tok = load_json(path)
    except (OSError, ValueError) as e:      # a missing file, a config transformers refuses
        raise _tokenizer_error(path, e) from None
    except Exception as e:   # the `tokenizers` library reports a file it cannot parse as a bare Exception
        if type(e) is not Exception:
            raise
        raise _tokenizer_error(path, e) from None
    if chat_template is not None:
        if not chat_template.exists():
            raise GraphError(Problem(f"chat template not found: {chat_template}", Location(str(chat_template)),
                                     hint="[data] chat_template: a Jinja file, relative to the graph file"))
        tok.chat_template = chat_template.read_text()
    elif not getattr(tok, "chat_template", None):
        beside = (path if path.is_dir() else path.parent) / "chat_template.jinja"
        if beside.exists():
            tok.chat_template = beside.read_text()
    return tok


def _tokenizer_error(path: Path, e: BaseException) -> GraphError:
    return GraphError(Problem(f"cannot be read as a tokenizer ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})",
                              Location(str(path)),
                              hint="[data] tokenizer: the target's tokenizer.json, or a directory with its "
                                   "tokenizer_config.json (relative to the graph file)"))


# -- records ---------------------------------------------------------------------------------------------------
def _jsonl(path: Path) -> Iterator[tuple[dict[str, Any], int | None, int | None]]:
    with open(path, "rb") as f:    # decoded line by line, so that bytes that are not UTF-8 are found on their line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _err(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})", str(path), lineno,
                           hint="a JSONL corpus is UTF-8 text, one JSON object a line; for another kind of file "
                                "set [data] format (text, chat, tokens or hf)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err(f"not valid JSON ({e.msg} at column {e.colno})", str(path), lineno,
                           hint="each line must be one JSON object") from None
            if not isinstance(rec, dict):
                raise _err(f"a JSON {type(rec).__name__}, not an object", str(path), lineno,
                           hint="each line must be one JSON object, e.g. {\"text\": \"...\"}")
            yield rec, lineno, None


def _parquet(path: Path) -> Iterator[tuple[dict[str, Any], int | None, int | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise GraphError(Problem("reading a Parquet corpus needs the `pyarrow` package", Location(str(path)),
                                 hint='pip install "dflash-graph[data]"')) from None

    import pyarrow

    try:
        pf = pq.ParquetFile(str(path))
    except pyarrow.ArrowException as e:
        raise _err(f"not a readable Parquet file ({str(e).splitlines()[0][:200]})", str(path),
                   hint="write the corpus with pyarrow.parquet.write_table or Dataset.to_parquet, or use JSONL") from None
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield rec, None, row
            row += 1


def _hf(path: Path, split: str) -> Iterator[tuple[dict[str, Any], int | None, int | None]]:
    try:
        import datasets
    except ImportError:
        raise GraphError(Problem("reading a Hugging Face datasets corpus needs the `datasets` package",
                                 Location(str(path)), hint='pip install "dflash-graph[data]"')) from None
    datasets.disable_progress_bars()
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
    else:
        files = [str(p) for p in sorted(path.iterdir()) if p.is_file()] if path.is_dir() else [str(path)]
        ext = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
        kinds = {ext.get(Path(f).suffix) for f in files} - {None}
        if len(kinds) != 1:
            raise GraphError(Problem("cannot tell which datasets builder reads these files", Location(str(path)),
                                     expected="one kind of .json/.jsonl, .parquet, .csv or .arrow files",
                                     actual=", ".join(Path(f).name for f in files[:5]) or "no files",
                                     hint="point [data] corpus at a directory written by Dataset.save_to_disk, "
                                          "or at data files of one kind"))
        ds = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise GraphError(Problem(f"the dataset has no split '{split}'", Location(str(path)),
                                     expected=f"one of {sorted(ds)}", actual=split,
                                     hint="set [data] split to one of the dataset's splits"))
        ds = ds[split]
    for row, rec in enumerate(ds):
        yield rec, None, row


def records(path: Path, fmt: str, split: str = "train") -> tuple[str, Iterator]:
    """(container, iterator of (record, line, row)); container is jsonl, parquet or hf."""
    if not path.exists():
        raise GraphError(Problem(f"corpus not found: {path}", Location(str(path)),
                                 hint="[data] corpus is relative to the graph file"))
    if fmt == "hf" or (fmt == "auto" and path.is_dir()):
        return "hf", _hf(path, split)
    if path.is_dir():
        raise GraphError(Problem(f"the corpus is a directory, but [data] format is '{fmt}'", Location(str(path)),
                                 hint='a directory is read with format = "hf" (Hugging Face datasets)'))
    if path.suffix == ".parquet":
        return "parquet", _parquet(path)
    return "jsonl", _jsonl(path)


def record_kind(rec: Mapping[str, Any], text_key: str, messages_key: str) -> str | None:
    if messages_key in rec:
        return "chat"
    if "input_ids" in rec:
        return "tokens"
    if text_key in rec:
        return "text"
    return None


# -- one record to one document ------------------------------------------------------------------------------
class Reader:
    """Turns records into documents; `file`, `line`, `row` say where a bad one is."""

    def __init__(self, tok, kind: str, text_key: str = "text", messages_key: str = "messages",
                 vocab: int | None = None):
        self.tok, self.kind, self.text_key, self.messages_key = tok, kind, text_key, messages_key
        self.vocab = vocab
        self.eos = None
        if tok is not None:
            self.eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        if kind == "chat" and tok is not None and not getattr(tok, "chat_template", None):
            raise GraphError(Problem("chat data needs the target tokenizer's chat template, and this tokenizer "
                                     "has none", Location(None, None, "data.tokenizer"),
                                     hint="use the target's tokenizer directory (its tokenizer_config.json holds "
                                          "the template), put a chat_template.jinja beside tokenizer.json, or set "
                                          "[data] chat_template"))

    def document(self, rec: Mapping[str, Any], file: str, line: int | None, row: int | None) -> Document:
        where = dict(file=file, line=line, row=row)
        if self.kind == "text":
            text = rec.get(self.text_key)
            if self.text_key not in rec:
                raise _err(f"no '{self.text_key}' field (fields: {', '.join(sorted(rec)) or 'none'})", **where,
                           hint=f"every record needs a '{self.text_key}' string, or set [data] text_key")
            if not isinstance(text, str):
                raise _err(f"expected a string, got {type(text).__name__}", field=self.text_key, **where)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
            return Document(ids, [False] + [True] * (len(ids) - 1))
        if self.kind == "tokens":
            return self._tokens(rec, where)
        return self._chat(rec, where)

    def _tokens(self, rec, where) -> Document:
        ids = rec.get("input_ids")
        if "input_ids" not in rec:
            raise _err(f"no 'input_ids' field (fields: {', '.join(sorted(rec)) or 'none'})", **where,
                       hint="pre-tokenized records need 'input_ids' (a list of token ids) and may have 'loss_mask'")
        if not isinstance(ids, list) or not ids:
            raise _err(f"expected a non-empty list of token ids, got {type(ids).__name__}"
                       + (" (empty)" if isinstance(ids, list) else ""), field="input_ids", **where)
        for i, x in enumerate(ids):
            if isinstance(x, bool) or not isinstance(x, int):
                raise _err(f"token {i} is {x!r}, not an integer", field=f"input_ids[{i}]", **where)
            if x < 0 or (self.vocab is not None and x >= self.vocab):
                raise _err(f"token id {x} is outside the target's vocabulary [0, {self.vocab})",
                           field=f"input_ids[{i}]", hint="the ids must come from the target's tokenizer", **where)
        mask = rec.get("loss_mask")
        if mask is None:
            return Document(list(ids), [False] + [True] * (len(ids) - 1))
        if not isinstance(mask, list) or len(mask) != len(ids):
            n = len(mask) if isinstance(mask, list) else type(mask).__name__
            raise _err(f"loss_mask must be a list as long as input_ids ({len(ids)}), got {n}", field="loss_mask",
                       **where)
        out = []
        for i, m in enumerate(mask):
            if m not in (0, 1):     # True/False compare equal to 1/0
                raise _err(f"value {m!r} is not 0/1 or a boolean", field=f"loss_mask[{i}]", **where)
            out.append(bool(m))
        return Document(list(ids), out)

    def _chat(self, rec, where) -> Document:
        key = self.messages_key
        msgs = rec.get(key)
        if key not in rec:
            raise _err(f"no '{key}' field (fields: {', '.join(sorted(rec)) or 'none'})", **where,
                       hint=f"chat records need '{key}': a list of {{\"role\": ..., \"content\": ...}}")
        if not isinstance(msgs, list) or not msgs:
            raise _err("expected a non-empty list of messages", field=key, **where)
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping):
                raise _err(f"a message must be an object, got {type(m).__name__}", field=f"{key}[{i}]", **where)
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise _err(f"role {role!r} is not one of {', '.join(ROLES)}", field=f"{key}[{i}].role", **where)
            if not isinstance(content, str):
                raise _err(f"content must be a string, got {type(content).__name__}", field=f"{key}[{i}].content",
                           **where)
            clean.append({"role": role, "content": content})
        return render_chat(self.tok, clean, self.eos, where)


def render_chat(tok, messages: list[dict[str, str]], eos: int, where: Mapping[str, Any]) -> Document:
    """Render a conversation with the tokenizer's chat template; loss tokens are the tokens of each assistant
    message (what the template adds for it after the generation prompt), found by rendering the prefixes:
    message i spans [len(render(m[:i], add_generation_prompt=True)), len(render(m[:i+1]))) of the text. A token
    is a loss token when its first character lies in such a span. The document ends with eos (a loss token
    when the conversation ends with the assistant), as text documents do."""

    def render(ms, gen=False) -> str:
        try:
            return tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen)
        except Exception as e:   # a template error is the template's, not ours: say which record broke it
            raise _err(f"the chat template failed on this conversation ({type(e).__name__}: {e})", **where,
                       hint="check the template, or the roles' order it expects") from None

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, upto = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(head)):
            raise _err("the chat template does not render this conversation's prefixes as prefixes of it, so its "
                       "assistant tokens cannot be located", field=f"messages[{i}]", **where,
                       hint="templates that rewrite earlier turns (e.g. dropping past reasoning) need pre-tokenized "
                            "data with a loss_mask (format = \"tokens\")")
        spans.append((len(head), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    loss = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    if not ids or ids[-1] != eos:
        ids.append(eos)
        loss.append(messages[-1]["role"] == "assistant")
    if loss:
        loss[0] = False     # the first token is never predicted
    return Document(ids, loss)


def read_documents(path: Path, tok, fmt: str = "auto", text_key: str = "text", messages_key: str = "messages",
                   split: str = "train", vocab: int | None = None) -> tuple[list[Document], str]:
    """Every document of the corpus, in file order, and the record kind (text, chat or tokens)."""
    container, it = records(path, fmt, split)
    reader = None
    docs = []
    for rec, line, row in it:
        if reader is None:
            kind = fmt if fmt in ("text", "chat", "tokens") else record_kind(rec, text_key, messages_key)
            if kind is None:
                raise _err(f"cannot tell the record kind from its fields ({', '.join(sorted(rec)) or 'none'})",
                           str(path), line, row=row,
                           hint=f"records need '{messages_key}' (chat), 'input_ids' (pre-tokenized) or "
                                f"'{text_key}' (text); or set [data] format / text_key")
            if tok is None and kind != "tokens":
                raise _err(f"{kind} data needs a tokenizer", str(path), line, row=row,
                           hint="set [data] tokenizer to the target's tokenizer")
            reader = Reader(tok, kind, text_key, messages_key, vocab)
        docs.append(reader.document(rec, str(path), line, row))
    if reader is None:
        raise GraphError(Problem("the corpus has no documents", Location(str(path)),
                                 hint="a JSONL corpus has one JSON object a line, e.g. {\"text\": \"...\"}; "
                                      "[data] corpus names it, relative to the graph file"))
    return docs, reader.kind
