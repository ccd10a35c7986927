#!/usr/bin/env python3
"""Generate graphs/tiny/corpus.jsonl: a small, regular, learnable text corpus.

The corpus feeds the embedded default graph ``graphs/tiny.toml``. It must be
learnable by a ~1.5M-parameter Qwen3.5 model in a few CPU minutes, and that
model must then be confident enough that a DFlash drafter has something to
learn. So the text comes from a tiny fixed "world" and a handful of templates:

* ``story``   - a short tale about a named animal; names, places and objects are
                drawn at random once and then repeated (copying from context),
                events come from a fixed set of sentence templates, every story
                ends with "The end."
* ``facts``   - fixed facts about the world ("The fox is red. The fox lives in
                the forest."): the same facts every time, so they are memorised.
* ``qa``      - questions and answers about those same facts.
* ``math``    - additions/subtractions of small numbers ("3 plus 4 is 7."), and
                counting by steps ("Count by 3 from 6: 6, 9, 12, ...").
* ``repeat``  - a random word list followed by the same list again (pure copy).

Documents are 50-600 tokens long (with the tiny tokenizer, about 4.3 characters
per token). The output is one JSON object per line: ``{"text": ...}``.
Everything is driven by ``random.Random(seed)``: the same seed gives the same
bytes. The last 50 documents are the held-out split that
tools/train_tiny_target.py (``--holdout 50``) never trains on.

Usage:  python tools/make_tiny_corpus.py [--out graphs/tiny/corpus.jsonl] [--seed 0] [--docs 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

# --------------------------------------------------------------------------- world
NAMES = [
    "Anna", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jack", "Kim", "Leo",
    "Mia", "Nora", "Omar", "Pia", "Rosa", "Sam", "Tom", "Uma", "Vic", "Wes", "Yara", "Zoe",
]  # fmt: skip
PRONOUN = {n: ("she" if n in {"Anna", "Cleo", "Eva", "Hana", "Ivy", "Kim", "Mia", "Nora", "Pia", "Rosa", "Uma", "Yara", "Zoe"} else "he") for n in NAMES}  # fmt: skip
POSSESSIVE = {"she": "her", "he": "his"}

# animal -> (color, home, food, sound, size)
ANIMALS = {
    "cat": ("gray", "house", "fish", "meow", "small"),
    "dog": ("brown", "yard", "bones", "woof", "big"),
    "fox": ("red", "forest", "berries", "yip", "small"),
    "owl": ("white", "tree", "mice", "hoot", "small"),
    "frog": ("green", "pond", "flies", "croak", "tiny"),
    "bear": ("black", "cave", "honey", "growl", "huge"),
    "duck": ("yellow", "lake", "bread", "quack", "small"),
    "cow": ("white", "farm", "grass", "moo", "big"),
    "horse": ("brown", "field", "hay", "neigh", "big"),
    "bee": ("yellow", "hive", "nectar", "buzz", "tiny"),
    "rabbit": ("gray", "burrow", "carrots", "squeak", "small"),
    "mouse": ("gray", "hole", "cheese", "squeak", "tiny"),
    "lion": ("gold", "den", "meat", "roar", "huge"),
    "goat": ("white", "hill", "leaves", "baa", "big"),
    "pig": ("pink", "farm", "apples", "oink", "big"),
    "crow": ("black", "tree", "seeds", "caw", "small"),
}
PLACES = ["river", "market", "beach", "school", "garden", "village", "castle", "bridge", "meadow", "library", "bakery", "harbor"]  # fmt: skip
OBJECTS = ["ball", "kite", "book", "hat", "key", "box", "lamp", "map", "cup", "drum", "shell", "coin", "bell", "boat"]  # fmt: skip
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "gray", "pink", "orange", "purple", "gold"]  # fmt: skip
FEELINGS = ["happy", "sad", "tired", "hungry", "brave", "calm", "excited", "sleepy"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip
REPEAT_WORDS = sorted(set(list(ANIMALS) + PLACES + OBJECTS + COLORS + FEELINGS + ["apple", "tree", "sun", "moon", "star", "rain", "snow", "song"]))  # fmt: skip


def plural(word: str) -> str:
    if word.endswith(("s", "sh", "x")):
        return word + "es"
    return word + "s"


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# Token budgets are counted with the GPT-2 pre-tokenizer pattern (one token per word,
# number or punctuation run, with its leading space); the tiny BPE vocabulary holds
# nearly every word of this corpus whole, so this is close to the real count (a few
# two-digit numbers split in two). Budgets keep a margin inside 50-600 real tokens.
MIN_TOKENS, MAX_TOKENS = 56, 540
_PRETOKEN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def estimate_tokens(sentences: list[str]) -> int:
    return sum(len(_PRETOKEN.findall(s)) + 1 for s in sentences)


# --------------------------------------------------------------------------- documents
def story(rng: random.Random, budget: int) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, friend_animal = rng.sample(sorted(ANIMALS), 2)
    color, home, food, sound, size = ANIMALS[animal]
    he = PRONOUN[name]
    his = POSSESSIVE[he]
    ffood = ANIMALS[friend_animal][2]
    obj = rng.choice(OBJECTS)
    obj_color = rng.choice(COLORS)
    out = [
        f"Once upon a time, there was {article(size)} {size} {color} {animal} named {name}.",
        f"{name} lived in the {home} with {his} friend {friend} the {friend_animal}.",
    ]
    ending_tokens = 22
    while estimate_tokens(out) + ending_tokens < budget:
        kind = rng.randrange(9)
        place = rng.choice(PLACES)
        if kind == 0:
            obj = rng.choice(OBJECTS)
            obj_color = rng.choice(COLORS)
            out.append(f"One day, {name} went to the {place}. At the {place}, {name} found {article(obj_color)} {obj_color} {obj}.")  # fmt: skip
        elif kind == 1:
            out.append(f"{name} gave the {obj_color} {obj} to {friend}. {friend} said, \"Thank you, {name}!\"")
        elif kind == 2:
            out.append(f"Then {name} and {friend} ate some {food} and some {ffood}. The {food} was very good.")
        elif kind == 3:
            feel = rng.choice(FEELINGS)
            out.append(f"{name} said \"{sound}, {sound}!\" because {he} was {feel}. {friend} was {feel} too.")
        elif kind == 4:
            w = rng.choice(WEATHER)
            out.append(f"It was {w} by the {place}, so {name} went back to the {home}.")
        elif kind == 5:
            n = rng.randint(2, 9)
            seq = ", ".join(NUMBER_WORDS[1 : n + 1])
            out.append(f"{name} counted the {plural(obj)}: {seq}. There were {NUMBER_WORDS[n]} {plural(obj)}.")
        elif kind == 6:
            day = rng.choice(DAYS)
            out.append(f"On {day}, {name} and {friend} walked to the {place} and played with the {obj}.")
        elif kind == 7:
            out.append(f"{friend} asked, \"Where is the {obj}?\" {name} said, \"The {obj} is in the {home}.\"")
        else:
            out.append(f"The {friend_animal} said hello to the {animal}, and the {animal} said hello to the {friend_animal}.")  # fmt: skip
    feel = rng.choice(FEELINGS)
    out.append(f"At the end of the day, {name} was {feel} and went to sleep in the {home}. The end.")
    return " ".join(out)


def facts(rng: random.Random, budget: int) -> str:
    out = ["Facts about animals."]
    for animal in rng.sample(sorted(ANIMALS), len(ANIMALS)):
        if len(out) > 1 and estimate_tokens(out) >= budget:
            break
        color, home, food, sound, size = ANIMALS[animal]
        out.append(
            f"The {animal} is {color}. The {animal} is {size}. The {animal} lives in the {home}. "
            f"The {animal} eats {food}. The {animal} says {sound}."
        )
    return " ".join(out)


def qa(rng: random.Random, budget: int) -> str:
    out: list[str] = []
    while estimate_tokens(out) < budget:
        animal = rng.choice(sorted(ANIMALS))
        color, home, food, sound, size = ANIMALS[animal]
        k = rng.randrange(5)
        if k == 0:
            out.append(f"Q: What color is the {animal}? A: The {animal} is {color}.")
        elif k == 1:
            out.append(f"Q: Where does the {animal} live? A: The {animal} lives in the {home}.")
        elif k == 2:
            out.append(f"Q: What does the {animal} eat? A: The {animal} eats {food}.")
        elif k == 3:
            out.append(f"Q: What does the {animal} say? A: The {animal} says {sound}.")
        else:
            out.append(f"Q: Is the {animal} big or small? A: The {animal} is {size}.")
    return "\n".join(out)


def math(rng: random.Random, budget: int) -> str:
    out = ["Let us do some math."]
    while estimate_tokens(out) < budget:
        k = rng.randrange(4)
        if k == 0:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            out.append(f"{a} plus {b} is {a + b}.")
        elif k == 1:
            a = rng.randint(0, 20)
            b = rng.randint(0, a)
            out.append(f"{a} minus {b} is {a - b}.")
        elif k == 2:
            a, b = rng.randint(0, 10), rng.randint(0, 10)
            out.append(f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {a + b}.")
        else:
            step, start = rng.randint(1, 5), rng.randint(0, 10)
            n = rng.randint(4, 10)
            seq = ", ".join(str(start + step * i) for i in range(n))
            out.append(f"Count by {step} from {start}: {seq}.")
    return " ".join(out)


def repeat(rng: random.Random, budget: int) -> str:
    out: list[str] = []
    while estimate_tokens(out) < budget:
        words = [rng.choice(REPEAT_WORDS) for _ in range(rng.randint(3, 8))]
        lst = ", ".join(words)
        out.append(f"Say the words: {lst}. Again: {lst}.")
    return " ".join(out)


def make_doc(rng: random.Random) -> str:
    """One document of about 50-600 tokens: a token budget is drawn (more short documents
    than long ones) and the chosen generator adds sentences until it is reached."""
    kind = rng.choices(["story", "facts", "qa", "math", "repeat"], weights=[40, 12, 18, 18, 12])[0]
    budget = MIN_TOKENS + int((MAX_TOKENS - MIN_TOKENS) * rng.random() ** 1.5)
    return {"story": story, "facts": facts, "qa": qa, "math": math, "repeat": repeat}[kind](rng, budget)


def generate(n_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [make_doc(rng) for _ in range(n_docs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "graphs/tiny/corpus.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=1000)
    args = p.parse_args()
    docs = generate(args.docs, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    n_chars = sum(len(d) for d in docs)
    print(f"wrote {len(docs)} documents, {n_chars} characters, {args.out.stat().st_size} bytes -> {args.out}")


if __name__ == "__main__":
    main()
