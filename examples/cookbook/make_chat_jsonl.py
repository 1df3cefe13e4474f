"""Write examples/cookbook/chat.jsonl: the small chat dataset that docs/cookbook.md trains on.

64 short conversations, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line (the
format ``InstructionDataset(format="messages")`` reads), in the shipped tokenizer's vocabulary: an
animal keeps a coloured object and the assistant says which; a quarter start with a system message,
another quarter ask a second question in a second turn. Deterministic (fixed seed, no third-party text):

    python examples/cookbook/make_chat_jsonl.py            # rewrite the file
    python examples/cookbook/make_chat_jsonl.py --check    # compare with the shipped file, exit 1 if it differs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from automodel.data.synthetic_corpus import ANIMALS, COLORS, OBJECTS

PATH = Path(__file__).with_name("chat.jsonl")
SYSTEM = "You are a careful assistant. Answer briefly."


def conversations(n: int = 64, seed: int = 30) -> list[dict]:
    """``n`` conversations ``{"messages": [...]}``: (system,) user, assistant (, user, assistant)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        animal, color, obj = rng.choice(ANIMALS), rng.choice(COLORS), rng.choice(OBJECTS)
        messages = [{"role": "system", "content": SYSTEM}] if i % 4 == 0 else []
        messages += [
            {"role": "user", "content": f"The {animal} keeps the {color} {obj}. What does the {animal} keep?"},
            {"role": "assistant", "content": f"The {color} {obj}."},
        ]
        if i % 4 == 3:
            messages += [
                {"role": "user", "content": f"What color is the {obj}?"},
                {"role": "assistant", "content": f"It is {color}."},
            ]
        out.append({"messages": messages})
    return out


def render(convs: list[dict]) -> str:
    return "".join(json.dumps(c) + "\n" for c in convs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    text = render(conversations())
    if args.check:
        same = PATH.is_file() and PATH.read_text(encoding="utf-8") == text
        print(f"{PATH}: {'up to date' if same else 'differs from what this script writes; rerun it'}")
        return 0 if same else 1
    PATH.write_text(text, encoding="utf-8")
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
