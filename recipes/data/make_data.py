"""Regenerate ``recipes/data/sft_tiny.jsonl``: small synthetic prompt/completion pairs.

Four toy tasks (reverse words, add two numbers, uppercase, sort letters), 64 examples
each, shuffled with a fixed seed. Every prompt + completion fits in 60 bytes, so with
the bundled byte-level tokenizer an example (plus eos) fits ``--max_seq_length 64``.

    python recipes/data/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT_FILE = Path(__file__).resolve().parent / "sft_tiny.jsonl"
SEED = 0
PER_TASK = 64
MAX_BYTES = 60

WORDS = [
    "red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird",
    "rock", "sand", "rain", "snow", "wind", "fire", "lake", "star", "leaf", "milk",
]


def reverse_words(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 4))
    return f"reverse words: {' '.join(words)}\n", " ".join(reversed(words))


def add_numbers(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    return f"add {a} and {b}\n", str(a + b)


def uppercase(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, 2)
    text = " ".join(words)
    return f"uppercase: {text}\n", text.upper()


def sort_letters(rng: random.Random) -> tuple[str, str]:
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", 5)
    return f"sort letters: {' '.join(letters)}\n", " ".join(sorted(letters))


TASKS = [reverse_words, add_numbers, uppercase, sort_letters]


def make_examples(seed: int = SEED) -> list[dict[str, str]]:
    """PER_TASK examples of every task, shuffled deterministically."""
    rng = random.Random(seed)
    examples = []
    for task in TASKS:
        for _ in range(PER_TASK):
            prompt, completion = task(rng)
            assert len((prompt + completion).encode()) <= MAX_BYTES, (prompt, completion)
            examples.append({"prompt": prompt, "completion": completion})
    rng.shuffle(examples)
    return examples


def main() -> None:
    examples = make_examples()
    with OUT_FILE.open("w", encoding="utf-8", newline="\n") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=True) + "\n")
    print(f"wrote {len(examples)} examples to {OUT_FILE}")


if __name__ == "__main__":
    main()
