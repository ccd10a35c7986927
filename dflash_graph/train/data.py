"""Training data: JSONL text, a local tokenizer, packing into sequences of `seq` tokens with document
boundaries kept (position ids restart at each document; the target runs documents separately and the drafter's
mask never crosses them).

Replica r of a group reads its own shard: the documents at positions r, r + R, r + 2R, ... of each epoch's
shuffled order. The shard is the same in one process and under torchrun (where each target rank reads only its
own), so both runs see the same batches. A shard's position is the number of sequences it has packed, so a
checkpoint records one number and --resume fast-forwards to it exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from ..errors import GraphError, Location, Problem


class PackedData:
    def __init__(self, corpus: Path, tokenizer: Path, seq: int, text_key: str = "text", seed: int = 0,
                 shard: int = 0, num_shards: int = 1, docs: "PackedData | None" = None):
        self.seq, self.seed = seq, seed
        self.shard, self.num_shards = shard, num_shards
        self.batches = 0
        if docs is not None:             # another shard of the same corpus: share its tokenized documents
            self.eos, self.docs = docs.eos, docs.docs
            self.epoch, self.cursor = 0, 0
            self._order = self._permutation()
            return
        from ..models.nn.qwen3_5 import load_tokenizer

        if not corpus.exists():
            raise GraphError(Problem(f"corpus not found: {corpus}", Location(str(corpus)), hint="[data] corpus is "
                                     "relative to the graph file"))
        if not tokenizer.exists():
            raise GraphError(Problem(f"tokenizer not found: {tokenizer}", Location(str(tokenizer)),
                                     hint="[data] tokenizer: a tokenizer.json or a local directory"))
        tok = load_tokenizer(tokenizer)
        self.eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        self.docs: list[list[int]] = []
        with open(corpus) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise GraphError(Problem(f"bad JSONL record ({type(e).__name__}: {e})", Location(str(corpus), lineno),
                                             hint=f"each line must be a JSON object with a '{text_key}' string")) from None
                ids = tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
                self.docs.append(ids[:seq])
        if not self.docs:
            raise GraphError(Problem("the corpus has no documents", Location(str(corpus))))
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.docs)))
        random.Random(self.seed * 1000003 + self.epoch).shuffle(order)
        mine = order[self.shard::self.num_shards]
        return mine or order[: 1]        # a corpus smaller than the number of shards: every shard reads doc 0

    def _next_doc(self) -> list[int]:
        if self.cursor >= len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation()
        doc = self.docs[self._order[self.cursor]]
        self.cursor += 1
        return doc

    def next_batch(self) -> dict[str, torch.Tensor]:
        """One packed sequence: whole documents while they fit, then padding (its own 'document', no loss)."""
        ids, pos, mask = [], [], []
        while True:
            state = (self.epoch, self.cursor, self._order)
            doc = self._next_doc()
            if len(ids) + len(doc) > self.seq:
                self.epoch, self.cursor, self._order = state   # keep it for the next sequence
                break
            ids += doc
            pos += list(range(len(doc)))
            mask += [True] * (len(doc) - 1) + [False]          # the last token (eos) has nothing to predict
            if len(ids) == self.seq:
                break
        self.batches += 1
        pad = self.seq - len(ids)
        ids += [self.eos] * pad
        pos += list(range(pad))
        mask += [False] * pad
        return {"input_ids": torch.tensor(ids, dtype=torch.int64), "position_ids": torch.tensor(pos, dtype=torch.int64),
                "loss_mask": torch.tensor(mask, dtype=torch.bool)}

    def state(self) -> dict:
        return {"batches": self.batches}

    def skip(self, n: int) -> None:
        """Fast-forward past n packed sequences (what --resume does: the checkpoint records how many)."""
        while self.batches < n:
            self.next_batch()
