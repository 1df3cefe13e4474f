"""Generate the shipped default corpus: synthetic English-like documents with learnable structure.

Everything here is produced by :mod:`random` from a fixed seed, so the corpus contains no
third-party text and is covered by this project's own license (Apache-2.0). The same functions
are run by ``scripts/make_data_assets.py`` to write ``automodel/data/assets/`` and by the tests to
check that the shipped files are exactly what the script produces.

Document kinds (each one teaches a pattern a small model can learn, several of them need
attention over long distances, which is what context parallelism is for):

- ``ledger``: people pass items to each other; the document states every running total, so
  predicting a total needs the earlier totals and the transfer (state tracking).
- ``recall``: a long list of facts ("The otter keeps the red lamp."), then questions about facts
  stated hundreds of tokens earlier (long-range retrieval).
- ``copy``: a random line, filler sentences, then the same line again (long-range copying).
- ``arithmetic``: small sums, differences and products.
- ``lists``: a list of numbers, then the list sorted, reversed, and its extremes.
- ``counting``: arithmetic progressions.

The instruction examples (``generate_instructions``) are short question/answer pairs over the
same domains, written both as ``prompt``/``response`` and as chat ``messages``.
"""

from __future__ import annotations

import random

__all__ = ["generate_corpus", "generate_instructions", "DOC_KINDS"]

NAMES = [
    "Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jon", "Kai", "Lea",
    "Max", "Nia", "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vik", "Wren", "Yara",
]  # fmt: skip
ITEMS = ["apples", "books", "coins", "cups", "keys", "pens", "shells", "stones", "stamps", "cards"]
ANIMALS = [
    "otter", "falcon", "badger", "heron", "lynx", "moth", "newt", "owl", "panda", "quail",
    "raven", "seal", "tiger", "viper", "whale", "yak", "zebra", "camel", "dingo", "eagle",
    "ferret", "gecko", "hare", "ibis", "jackal", "koala", "lemur", "mole", "bison", "crane",
]  # fmt: skip
COLORS = ["red", "blue", "green", "gold", "grey", "white", "black", "pink", "brown", "violet"]
OBJECTS = [
    "lamp", "boat", "drum", "kite", "bell", "map", "cloak", "ring", "clock", "harp",
    "sword", "shield", "vase", "chest", "flute", "crown", "mask", "rope", "wheel", "jar",
]  # fmt: skip
PLACES = ["the mill", "the harbor", "the tower", "the market", "the garden", "the bridge", "the cave"]
WORDS = [
    "north", "river", "stone", "quiet", "bright", "seven", "amber", "little", "swift", "cold",
    "maple", "silver", "storm", "candle", "window", "paper", "honey", "winter", "echo", "salt",
    "orbit", "velvet", "cedar", "lantern", "pepper", "thunder", "meadow", "copper", "glass", "feather",
]  # fmt: skip
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _ledger(rng: random.Random) -> str:
    people = rng.sample(NAMES, rng.randint(2, 4))
    item = rng.choice(ITEMS)
    counts = {p: rng.randint(2, 12) for p in people}
    lines = [f"{p} has {counts[p]} {item}." for p in people]
    for _ in range(rng.randint(3, 10)):
        giver, taker = rng.sample(people, 2)
        if counts[giver] == 0:
            lines.append(f"{giver} has no {item} to give to {taker}.")
            continue
        k = rng.randint(1, min(4, counts[giver]))
        counts[giver] -= k
        counts[taker] += k
        noun = item if k > 1 else item[:-1]
        lines.append(f"{giver} gives {k} {noun} to {taker}.")
        lines.append(f"Now {giver} has {counts[giver]} and {taker} has {counts[taker]}.")
    total = sum(counts.values())
    lines.append("In the end, " + ", ".join(f"{p} has {counts[p]}" for p in people) + ".")
    lines.append(f"Together they have {total} {item}.")
    return "\n".join(lines)


def _recall(rng: random.Random) -> str:
    n = rng.randint(12, 45)
    owners = rng.sample(ANIMALS, min(n, len(ANIMALS)))
    things = rng.sample([(c, o) for c in COLORS for o in OBJECTS], len(owners))
    lines = ["Facts:"]
    for a, (c, o) in zip(owners, things):
        lines.append(f"The {a} keeps the {c} {o}.")
    lines.append("Questions:")
    for i in rng.sample(range(len(owners)), rng.randint(4, min(12, len(owners)))):
        a, (c, o) = owners[i], things[i]
        if rng.random() < 0.5:
            lines.append(f"Who keeps the {c} {o}? The {a}.")
        else:
            lines.append(f"What does the {a} keep? The {c} {o}.")
    return "\n".join(lines)


def _copy(rng: random.Random) -> str:
    line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16)))
    lines = [f"Remember this line: {line}."]
    for _ in range(rng.randint(3, 12)):
        a, c, o, p = rng.choice(ANIMALS), rng.choice(COLORS), rng.choice(OBJECTS), rng.choice(PLACES)
        lines.append(f"A {a} carried a {c} {o} to {p}.")
    lines.append(f"The line was: {line}.")
    return "\n".join(lines)


def _arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(5, 16)):
        op = rng.choice("+-*")
        if op == "+":
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{a} + {b} = {a + b}.")
        elif op == "-":
            a = rng.randint(0, 99)
            b = rng.randint(0, a)
            lines.append(f"{a} - {b} = {a - b}.")
        else:
            a, b = rng.randint(0, 12), rng.randint(0, 12)
            lines.append(f"{a} * {b} = {a * b}.")
    return "\n".join(lines)


def _lists(rng: random.Random) -> str:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 10))]
    lines = [
        "list: " + " ".join(map(str, xs)),
        "sorted: " + " ".join(map(str, sorted(xs))),
        "reversed: " + " ".join(map(str, reversed(xs))),
        f"largest: {max(xs)}",
        f"smallest: {min(xs)}",
        f"count: {len(xs)}",
    ]
    return "\n".join(lines)


def _counting(rng: random.Random) -> str:
    step = rng.randint(1, 9)
    start = rng.randint(0, 50)
    n = rng.randint(6, 20)
    seq = ", ".join(str(start + i * step) for i in range(n))
    word = NUMBER_WORDS[step] if step < len(NUMBER_WORDS) else str(step)
    return f"Counting by {word} from {start}: {seq}."


DOC_KINDS = {
    "ledger": (_ledger, 3),
    "recall": (_recall, 3),
    "copy": (_copy, 2),
    "arithmetic": (_arithmetic, 2),
    "lists": (_lists, 2),
    "counting": (_counting, 1),
}


def generate_corpus(num_docs: int = 4000, seed: int = 1234) -> list[str]:
    """Return ``num_docs`` synthetic documents (plain strings, no trailing newline).

    Deterministic: the same ``(num_docs, seed)`` gives the same list on every platform
    (only :class:`random.Random` integer/choice/sample calls are used).
    """
    if num_docs < 1:
        raise ValueError(f"num_docs={num_docs} must be >= 1; pass a positive number of documents")
    rng = random.Random(seed)
    kinds = list(DOC_KINDS)
    weights = [DOC_KINDS[k][1] for k in kinds]
    return [DOC_KINDS[rng.choices(kinds, weights)[0]][0](rng) for _ in range(num_docs)]


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return f"What is {a} * {b}?", f"{a} * {b} = {a * b}."
    if kind == 2:
        xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
        return "Sort these numbers: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))
    if kind == 3:
        ws = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        return "Reverse the words: " + " ".join(ws), " ".join(reversed(ws))
    if kind == 4:
        xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
        return "Which number is largest: " + " ".join(map(str, xs)) + "?", f"The largest is {max(xs)}."
    a, c, o = rng.choice(ANIMALS), rng.choice(COLORS), rng.choice(OBJECTS)
    return f"The {a} keeps the {c} {o}. What does the {a} keep?", f"The {c} {o}."


SYSTEM_PROMPT = "You are a careful assistant. Answer briefly."


def generate_instructions(num_examples: int = 2000, seed: int = 4321) -> list[dict]:
    """Return ``num_examples`` instruction examples, each
    ``{"prompt": str, "response": str, "messages": [system, user, assistant(, user, assistant)]}``.

    ``prompt``/``response`` is the plain format: the prompt ends with ``"\\nAnswer:"`` and the
    response starts with the separating space, because byte-level BPE attaches a space to the word
    after it, so tokenizing prompt and response separately gives the same tokens as tokenizing
    their concatenation; ``messages`` is the chat format, about a quarter of them with
    a second user/assistant turn so multi-turn masking is exercised. Deterministic in the seed.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples} must be >= 1; pass a positive number")
    rng = random.Random(seed)
    out = []
    for _ in range(num_examples):
        q, a = _qa(rng)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": q},
            {"role": "assistant", "content": a},
        ]
        if rng.random() < 0.25:
            q2, a2 = _qa(rng)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        out.append({"prompt": f"Question: {q}\nAnswer:", "response": " " + a, "messages": messages})
    return out
