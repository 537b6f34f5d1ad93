"""Summarises a `py-spy record --format raw` profile: the functions with the most samples.

    python benchmarks/device/pyspy_top.py PROFILE.txt [--top 40]

Per stack root (process/thread), then over all stacks: inclusive samples (the function is on the
stack) and self samples (it is the innermost frame), as shares of the samples.
"""

from __future__ import annotations

import argparse
import collections
import re


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines merged, so a function is one row."""
    match = re.match(r"(.*) \((.*?):\d+\)$", frame.strip())
    if not match:
        return frame.strip()
    return f"{match.group(1)} ({match.group(2).rsplit('/', 1)[-1]})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    inclusive, leaf, roots = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in open(args.profile):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        count = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += count
        roots[";".join(frames[:2])] += count
        for name in set(frames):
            inclusive[name] += count
        leaf[frames[-1]] += count
    print(f"{total} samples")
    print("\n## roots (process; thread)")
    for name, count in roots.most_common(15):
        print(f"{100 * count / total:6.1f}%  {name}")
    print("\n## inclusive")
    for name, count in inclusive.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")
    print("\n## self")
    for name, count in leaf.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")


if __name__ == "__main__":
    main()
