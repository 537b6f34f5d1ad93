"""Writes a small dataset of arithmetic word problems in GSM8K's layout: a `question` and an
`answer` that works the problem and ends with `#### N`.

    python examples/math/generate.py                 # examples/math/data/{train,eval}.jsonl
    python examples/math/generate.py --out DIR --train 5000 --eval 500 --seed 1

The same arguments always write the same files; no question appears twice, in or across splits.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "data"
NAMES = "Ada Ben Cleo Dana Eli Finn Hugo Ida Jack Kai Leo Mia Nina Omar Rosa Sam Uma Zoe".split()
ITEMS = "apples pencils stickers marbles cards shells stamps buttons".split()


def _add_sub(rng: random.Random) -> tuple[str, str, int]:
    a, b, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    while b == a:
        b = rng.choice(NAMES)
    x, y = rng.randint(5, 60), rng.randint(2, 40)
    z = rng.randint(1, x + y - 1)
    total = x + y - z
    return (f"{a} has {x} {item}. {a} buys {y} more and gives {z} to {b}. How many {item} does {a} have now?",
            f"After buying, {a} has {x} + {y} = {x + y} {item}. After giving {z} away, {a} has "
            f"{x + y} - {z} = {total} {item}.", total)


def _multiply(rng: random.Random) -> tuple[str, str, int]:
    a, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, each = rng.randint(2, 12), rng.randint(2, 25)
    return (f"{a} packs {boxes} boxes with {each} {item} in each box. How many {item} does {a} pack?",
            f"{a} packs {boxes} * {each} = {boxes * each} {item}.", boxes * each)


def _divide(rng: random.Random) -> tuple[str, str, int]:
    a, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 15)
    return (f"{a} shares {friends * each} {item} equally among {friends} friends. "
            f"How many {item} does each friend get?",
            f"Each friend gets {friends * each} / {friends} = {each} {item}.", each)


def _change(rng: random.Random) -> tuple[str, str, int]:
    a = rng.choice(NAMES)
    thing = rng.choice(["notebook", "sandwich", "ticket", "plant", "toy car"])
    price, count = rng.randint(2, 15), rng.randint(1, 6)
    bill = next(b for b in (10, 20, 50, 100) if b >= price * count)
    change = bill - price * count
    return (f"A {thing} costs ${price}. {a} buys {count} of them and pays with a ${bill} bill. "
            f"How much change, in dollars, does {a} get?",
            f"{count} of them cost {count} * {price} = ${price * count}. The change is "
            f"{bill} - {price * count} = ${change}.", change)


def _rate(rng: random.Random) -> tuple[str, str, int]:
    a = rng.choice(NAMES)
    per_day, days = rng.randint(3, 40), rng.randint(2, 14)
    return (f"{a} reads {per_day} pages every day. How many pages does {a} read in {days} days?",
            f"In {days} days {a} reads {per_day} * {days} = {per_day * days} pages.", per_day * days)


def _times_as_many(rng: random.Random) -> tuple[str, str, int]:
    a, b, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    while b == a:
        b = rng.choice(NAMES)
    x, k = rng.randint(2, 30), rng.randint(2, 5)
    return (f"{a} has {x} {item}. {b} has {k} times as many {item} as {a}. "
            f"How many {item} do they have together?",
            f"{b} has {k} * {x} = {k * x} {item}. Together they have {x} + {k * x} = {x + k * x} {item}.",
            x + k * x)


def _left_over(rng: random.Random) -> tuple[str, str, int]:
    a = rng.choice(NAMES)
    per_day, days = rng.randint(1, 6), rng.randint(2, 7)
    baked = per_day * days + rng.randint(0, 30)
    left = baked - per_day * days
    return (f"{a} bakes {baked} cookies and eats {per_day} of them every day for {days} days. "
            f"How many cookies are left?",
            f"{a} eats {per_day} * {days} = {per_day * days} cookies, so {baked} - {per_day * days} = "
            f"{left} are left.", left)


TEMPLATES = (_add_sub, _multiply, _divide, _change, _rate, _times_as_many, _left_over)


def make_problems(count: int, seed: int) -> list[dict[str, str]]:
    """`count` distinct problems, `{"question", "answer"}`, the answer ending in `#### N`."""
    rng = random.Random(f"math_word_problems:{seed}")
    problems: dict[str, str] = {}
    while len(problems) < count:
        question, work, answer = rng.choice(TEMPLATES)(rng)
        problems.setdefault(question, f"{work}\n#### {answer}")
    return [{"question": q, "answer": a} for q, a in problems.items()]


def write_splits(out: Path, train: int, eval_: int, seed: int) -> tuple[Path, Path]:
    problems = make_problems(train + eval_, seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (problems[:train], problems[train:])):
        path.write_text("".join(json.dumps(p) + "\n" for p in part))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=500, help="train problems")
    parser.add_argument("--eval", type=int, default=100, help="eval problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_splits(args.out, args.train, args.eval, args.seed):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
