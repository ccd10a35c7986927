#!/usr/bin/env python3
"""Generate graphs/tiny/chat.jsonl: a small chat-format corpus in the same tiny world as corpus.jsonl.

Each line is {"messages": [{"role": "user" | "assistant" | "system", "content": ...}, ...]}: one to four turns
of questions about the world's animals, sums, counting and word lists, answered in the sentences the tiny target
was trained on (tools/make_tiny_corpus.py), and now and then a story. graphs/tiny/chat_template.jinja renders it
("role: content" lines); dflash-graph trains the drafter on the assistant's tokens only.

Usage:  python tools/make_tiny_chat.py [--out graphs/tiny/chat.jsonl] [--seed 1] [--conversations 400]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_corpus import ANIMALS, NUMBER_WORDS, REPEAT_WORDS, story  # noqa: E402


def turn(rng: random.Random) -> tuple[str, str]:
    k = rng.choices(["animal", "sum", "count", "repeat", "story"], weights=[35, 25, 15, 15, 10])[0]
    if k == "animal":
        animal = rng.choice(sorted(ANIMALS))
        color, home, food, sound, size = ANIMALS[animal]
        q, a = rng.choice([
            (f"What color is the {animal}?", f"The {animal} is {color}."),
            (f"Where does the {animal} live?", f"The {animal} lives in the {home}."),
            (f"What does the {animal} eat?", f"The {animal} eats {food}."),
            (f"What does the {animal} say?", f"The {animal} says {sound}."),
            (f"Tell me about the {animal}.", f"The {animal} is {color}. The {animal} is {size}. The {animal} lives "
                                             f"in the {home}. The {animal} eats {food}. The {animal} says {sound}."),
        ])
        return q, a
    if k == "sum":
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            return f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?", f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {a + b}."
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
    if k == "count":
        step, start, n = rng.randint(1, 5), rng.randint(0, 10), rng.randint(4, 10)
        seq = ", ".join(str(start + step * i) for i in range(n))
        return f"Count by {step} from {start}, {n} numbers.", f"Count by {step} from {start}: {seq}."
    if k == "repeat":
        lst = ", ".join(rng.choice(REPEAT_WORDS) for _ in range(rng.randint(3, 8)))
        return f"Say the words: {lst}.", f"Again: {lst}."
    return "Tell me a story.", story(rng, rng.randint(60, 160))


def conversation(rng: random.Random) -> dict:
    msgs = []
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": "You answer questions about the animals and numbers."})
    for _ in range(rng.choices([1, 2, 3, 4], weights=[40, 30, 20, 10])[0]):
        q, a = turn(rng)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "graphs/tiny/chat.jsonl"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=400)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.conversations):
            f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
    main()
