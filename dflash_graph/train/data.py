"""Training data: a corpus (train/corpus.py: text, chat, pre-tokenized, Hugging Face datasets) split into a
training part and a held-out part, packed into sequences of `seq` tokens with document boundaries kept (position
ids restart at each document; the target runs documents separately and the drafter's mask never crosses them).

Replica r of a group reads its own shard (`PackedData.shard`): the documents at positions r, r + R, r + 2R, ... of
each epoch's shuffled order. The shard is the same in one process and under torchrun (where each target rank
reads only its own), so both runs see the same batches. A shard's position is the number of sequences it has
packed, so a checkpoint records one number and --resume fast-forwards to it exactly."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import GraphError, Location, Problem
from .corpus import FORMATS, Document, load_tokenizer, read_documents


class PackedData:
    """Packs documents into sequences: whole documents while they fit, then padding (its own 'document', no
    loss). Training order: a seeded shuffle per epoch. `loss_mask[t]`: token t is a loss token."""

    def __init__(self, corpus: Path | None = None, tokenizer: Path | None = None, seq: int = 256,
                 text_key: str = "text", seed: int = 0, *, docs: list[Document] | None = None, eos: int = 0,
                 shuffle: bool = True, shard: int = 0, num_shards: int = 1):
        self.seq, self.seed, self.shuffle = seq, seed, shuffle
        self.shard_index, self.num_shards = shard, num_shards
        self.batches = 0
        if docs is None:
            tok = load_tokenizer(_exists(tokenizer, "tokenizer"))
            docs, _ = read_documents(corpus, tok, "auto", text_key)
            eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        self.eos = eos
        self.docs = [d if len(d) <= seq else Document(d.ids[:seq], d.loss[:seq]) for d in docs]
        if not self.docs:
            raise GraphError(Problem("the corpus has no documents", Location(str(corpus) if corpus else None)))
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.docs)))
        if self.shuffle:
            random.Random(self.seed * 1000003 + self.epoch).shuffle(order)
        mine = order[self.shard_index::self.num_shards]
        return mine or order[:1]         # a corpus smaller than the number of shards: every shard reads doc 0

    def shard(self, r: int, num_shards: int) -> "PackedData":
        """Replica r's shard of the same documents (tokenized once)."""
        return PackedData(seq=self.seq, seed=self.seed, docs=self.docs, eos=self.eos, shuffle=self.shuffle,
                          shard=r, num_shards=num_shards)

    def _next_doc(self) -> Document:
        if self.cursor >= len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation()
        doc = self.docs[self._order[self.cursor]]
        self.cursor += 1
        return doc

    def _pack(self, take) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        mask: list[bool] = []
        while True:
            doc = take(len(ids))
            if doc is None:
                break
            ids += doc.ids
            pos += range(len(doc))
            mask += doc.loss
            if len(ids) == self.seq:
                break
        pad = self.seq - len(ids)
        ids += [self.eos] * pad
        pos += range(pad)
        mask += [False] * pad
        return {"input_ids": torch.tensor(ids, dtype=torch.int64), "position_ids": torch.tensor(pos, dtype=torch.int64),
                "loss_mask": torch.tensor(mask, dtype=torch.bool)}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next packed training sequence."""
        self.batches += 1
        def take(n: int) -> Document | None:
            state = (self.epoch, self.cursor, self._order)
            doc = self._next_doc()
            if n + len(doc) > self.seq:
                self.epoch, self.cursor, self._order = state   # keep it for the next sequence
                return None
            return doc
        return self._pack(take)

    def sequences(self, limit: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """One pass over every document in order, packed (the held-out split's evaluation); the training
        position is untouched."""
        i = 0
        made = 0
        while i < len(self.docs) and (limit is None or made < limit):
            def take(n: int) -> Document | None:
                nonlocal i
                if i >= len(self.docs) or n + len(self.docs[i]) > self.seq:
                    return None
                i += 1
                return self.docs[i - 1]
            yield self._pack(take)
            made += 1

    @property
    def loss_tokens(self) -> int:
        return sum(sum(d.loss) for d in self.docs)

    def state(self) -> dict:
        return {"batches": self.batches}

    def skip(self, n: int) -> None:
        """Fast-forward past n packed sequences (what --resume does: the checkpoint records how many)."""
        while self.batches < n:
            self.next_batch()


def _toml_only(*path: str) -> Location:
    return Location(path=".".join(path))


def _exists(p: Path | None, what: str, where: Callable[..., Location] = _toml_only) -> Path:
    if p is None or not p.exists():
        hint = {"tokenizer": "[data] tokenizer: a tokenizer.json or a local directory (relative to the graph file)",
                "corpus": "[data] corpus is relative to the graph file"}[what]
        raise GraphError(Problem(f"{what} not found: {p}", where("data", what), hint=hint))
    return p


def load_data(data: Mapping[str, Any], base: Path, seq: int, seed: int, vocab: int | None = None,
              where: Callable[..., Location] = _toml_only) -> tuple[PackedData, PackedData | None]:
    """The training split and the held-out split (the last `[data] holdout` documents of the corpus, in file
    order; never trained on) from a graph's [data] section. Refuses, before any step runs, a corpus whose
    training split has no loss token. `where("data", KEY)` locates a [data] key in the graph file (GraphSpec.loc)."""
    fmt = data.get("format", "auto")
    if fmt not in FORMATS:
        raise GraphError(Problem(f"unknown data format '{fmt}'", where("data", "format"),
                                 expected=" | ".join(FORMATS), actual=fmt))
    corpus = _exists(base / data["corpus"], "corpus", where)
    tok = None
    if data.get("tokenizer"):
        ct = data.get("chat_template")
        tok = load_tokenizer(_exists(base / data["tokenizer"], "tokenizer", where), base / ct if ct else None)
    docs, kind = read_documents(corpus, tok, fmt, data.get("text_key", "text"), data.get("messages_key", "messages"),
                                data.get("split", "train"), vocab)
    eos = (tok.eos_token_id if tok is not None and tok.eos_token_id is not None else 0)
    holdout = int(data.get("holdout", 0))
    if holdout < 0 or holdout >= len(docs):
        raise GraphError(Problem(f"[data] holdout = {holdout} " + ("is negative" if holdout < 0 else
                                                                   "leaves no document to train on"),
                                 where("data", "holdout"),
                                 expected=f"0 <= holdout < {len(docs)} (the corpus has {len(docs)} documents)",
                                 actual=str(holdout)))
    train_docs, held_docs = (docs[:-holdout], docs[-holdout:]) if holdout else (docs, [])
    train = PackedData(seq=seq, seed=seed, docs=train_docs, eos=eos)
    if train.loss_tokens == 0:
        what = "assistant message" if kind == "chat" else "token marked in loss_mask" if kind == "tokens" else "token"
        raise GraphError(Problem(f"the corpus has no loss token: no {what} in its {len(train_docs)} training "
                                 "documents, so there is nothing to train the drafter on",
                                 Location(str(corpus)),
                                 hint="chat data: only assistant messages are trained on; pre-tokenized data: "
                                      "loss_mask needs some 1s after each record's first token"))
    held = PackedData(seq=seq, seed=seed, docs=held_docs, eos=eos, shuffle=False) if held_docs else None
    return train, held
