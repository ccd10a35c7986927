"""Data people have: text, chat (the tokenizer's own template, loss on assistant tokens only), pre-tokenized JSONL
and Parquet, Hugging Face datasets directories and files; a located error for every bad record; a corpus with no
loss token refused; a held-out split that is never trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_graph.cli.main import main
from dflash_graph.errors import GraphError
from dflash_graph.train.corpus import load_tokenizer, read_documents
from dflash_graph.train.data import load_data

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "graphs" / "tiny"
TOK = TINY / "tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOK)


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the fox?"},
                  {"role": "assistant", "content": "The fox is red."}, {"role": "user", "content": "And the owl?"},
                  {"role": "assistant", "content": "The owl is brown."}]},
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "4."}]},
]


def test_chat_loss_is_on_the_assistant_tokens_only(tmp_path, tok):
    docs, kind = read_documents(write_jsonl(tmp_path / "c.jsonl", CHAT), tok)
    assert kind == "chat"
    d = docs[0]
    text = tok.decode(d.ids)
    assert text == ("system: Be brief.\nuser: What color is the fox?\nassistant: The fox is red.\nuser: And the owl?\n"
                    "assistant: The owl is brown.\n<|endoftext|>")         # graphs/tiny/chat_template.jinja
    trained = tok.decode([i for i, m in zip(d.ids, d.loss) if m])
    assert trained == " The fox is red.\n The owl is brown.\n<|endoftext|>"
    untrained = tok.decode([i for i, m in zip(d.ids, d.loss) if not m])
    assert "What color" in untrained and "fox is red" not in untrained and "assistant:" in untrained


def test_chat_uses_the_tokenizer_directorys_own_template(tmp_path):
    """A tokenizer directory with a tokenizer_config.json goes through AutoTokenizer, template included."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(TOK, d / "tokenizer.json")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": template}))
    t = load_tokenizer(d)
    docs, _ = read_documents(write_jsonl(tmp_path / "c.jsonl", CHAT[1:]), t)
    assert t.decode(docs[0].ids) == "<user>What is two plus two?<assistant>4.<|endoftext|>"
    assert t.decode([i for i, m in zip(docs[0].ids, docs[0].loss) if m]) == "4.<|endoftext|>"


def test_text_and_pretokenized_jsonl_and_parquet(tmp_path, tok):
    docs, kind = read_documents(write_jsonl(tmp_path / "t.jsonl", [{"text": "The fox is red."}]), tok)
    assert kind == "text" and docs[0].loss == [False] + [True] * (len(docs[0].ids) - 1)
    recs = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10, 11]}]
    docs, kind = read_documents(write_jsonl(tmp_path / "p.jsonl", recs), None, vocab=768)
    assert kind == "tokens"
    assert [(d.ids, d.loss) for d in docs] == [([5, 6, 7, 8], [False, False, True, True]),
                                               ([9, 10, 11], [False, True, True])]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(recs[:1] + [{"input_ids": [9, 10, 11], "loss_mask": [1, 1, 0]}]),
                   tmp_path / "p.parquet")
    docs, kind = read_documents(tmp_path / "p.parquet", None, vocab=768)
    assert [(d.ids, d.loss) for d in docs] == [([5, 6, 7, 8], [False, False, True, True]),
                                               ([9, 10, 11], [True, True, False])]


def test_hugging_face_datasets_directory_and_files(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(CHAT),
                               "test": datasets.Dataset.from_list([{"text": "The owl is brown."}])})
    ds.save_to_disk(str(tmp_path / "dd"))
    docs, kind = read_documents(tmp_path / "dd", tok)                     # auto: a directory is datasets'
    assert kind == "chat" and len(docs) == 2
    docs, kind = read_documents(tmp_path / "dd", tok, split="test")
    assert kind == "text" and len(docs) == 1
    with pytest.raises(GraphError, match="no split 'validation'"):
        read_documents(tmp_path / "dd", tok, split="validation")
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "a.jsonl", CHAT)
    docs, kind = read_documents(files, tok, fmt="hf")                     # data files through load_dataset
    assert kind == "chat" and len(docs) == 2


BAD = [
    ("not json", ['{"text": "ok"}', '{"text": oops}'], ":2:", "not valid JSON"),
    ("not an object", ['["text"]'], ":1:", "not an object"),
    ("no field", [{"text": "ok"}, {"txt": "x"}], ":2:", "no 'text' field"),
    ("text not a string", [{"text": 3}], "field 'text'", "expected a string"),
    ("bad role", [CHAT[1], {"messages": [{"role": "bot", "content": "hi"}]}], "field 'messages[0].role'", "'bot'"),
    ("content not a string", [{"messages": [{"role": "user", "content": None}]}], "field 'messages[0].content'",
     "content must be a string"),
    ("empty messages", [{"messages": []}], "field 'messages'", "non-empty list"),
    ("ids not ints", [{"input_ids": [1, "2"]}], "field 'input_ids[1]'", "not an integer"),
    ("id outside vocab", [{"input_ids": [1, 9999]}], "field 'input_ids[1]'", "outside the target's vocabulary"),
    ("mask length", [{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}], "field 'loss_mask'", "as long as input_ids"),
    ("mask value", [{"input_ids": [1, 2], "loss_mask": [0, 2]}], "field 'loss_mask[1]'", "not 0/1"),
]


@pytest.mark.parametrize("name,records,where,what", BAD, ids=[b[0] for b in BAD])
def test_bad_records_give_a_located_error(tmp_path, tok, name, records, where, what):
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(GraphError) as e:
        read_documents(path, tok, vocab=768)
    msg = str(e.value)
    assert str(path) in msg and where in msg and what in msg, msg


def test_bad_parquet_row_is_located(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"input_ids": [1, 2]}, {"input_ids": [3, 70000]}]), tmp_path / "b.parquet")
    with pytest.raises(GraphError, match=r"row 1, field 'input_ids\[1\]'.*70000|70000.*row 1"):
        read_documents(tmp_path / "b.parquet", None, vocab=768)


def test_a_corpus_without_loss_tokens_is_refused(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}] * 3)
    shutil.copy(TOK, tmp_path / "tokenizer.json")
    shutil.copy(TINY / "chat_template.jinja", tmp_path / "chat_template.jinja")
    with pytest.raises(GraphError, match="no loss token: no assistant message"):
        load_data({"corpus": "c.jsonl", "tokenizer": "tokenizer.json"}, tmp_path, 64, 0)


def test_the_cli_refuses_bad_data_before_training_without_a_traceback(in_repo, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [CHAT[0], {"messages": [{"role": "user"}]}])
    code = main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(tmp_path / "o"), "--no-progress",
                 "--set", f"data.corpus={bad}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2: error at field 'messages[0].content'" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_the_held_out_split_is_never_trained_on():
    train, held = load_data({"corpus": "tiny/chat.jsonl", "tokenizer": "tiny/tokenizer.json", "holdout": 40},
                            REPO / "graphs", 256, 0, 768)
    assert len(held.docs) == 40 and len(train.docs) + 40 == sum(1 for _ in open(TINY / "chat.jsonl"))
    held_ids = {id(d) for d in held.docs}
    assert not held_ids & {id(d) for d in train.docs}
    # two epochs of training batches: every document packed is a training document
    seen, take = [], train._next_doc

    def spy():
        d = take()
        seen.append(id(d))
        return d

    train._next_doc = spy
    while train.epoch < 2:
        train.next_batch()
    assert len(set(seen)) == len(train.docs) and not set(seen) & held_ids
    seqs = list(held.sequences())
    assert sum(int(s["loss_mask"].sum()) for s in seqs) == held.loss_tokens   # one pass holds every held-out doc


def test_holdout_larger_than_the_corpus_is_an_error():
    with pytest.raises(GraphError, match="holdout = 5000 leaves no document"):
        load_data({"corpus": "tiny/chat.jsonl", "tokenizer": "tiny/tokenizer.json", "holdout": 5000},
                  REPO / "graphs", 256, 0, 768)


def test_a_chat_run_reports_tau_and_the_held_out_split(in_repo, tmp_path):
    out = tmp_path / "chat"
    assert main(["run", "graphs/tiny.toml", "--steps", "2", "--out", str(out), "--no-progress",
                 "--set", "data.corpus=tiny/chat.jsonl", "--set", "data.holdout=40",
                 "--set", "train.eval_every=2", "--set", "train.eval_batches=1"]) == 0
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["tau"] >= 1 and len(r["slot_accept"]) == 3
        # coverage per slot: slot 0 (the anchor) is never scored; what a step's anchors score is a part of what
        # the anchor rule can reach
        assert r["slot_reach"][0] is None and r["slot_scored"][0] is None and len(r["slot_reach"]) == 4
        assert all(0 < s <= q <= 1 for s, q in zip(r["slot_scored"][1:], r["slot_reach"][1:])), r
    assert "heldout" not in recs[0]
    h = recs[1]["heldout"]
    assert h["tau"] >= 1 and h["anchors"] > 0 and h["sequences"] == 2 and len(h["slot_accept"]) == 3
