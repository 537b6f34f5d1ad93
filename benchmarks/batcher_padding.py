"""Padding fraction of the Batcher on alphabet_sort episodes.

    .venv/bin/python benchmarks/batcher_padding.py [--steps 20] [--out benchmarks/results/batcher_padding.md]

Prints the report and adds a row per layout to the results table (results_table.py).

Episodes come from real alphabet_sort rollouts (the env, the tiny checkpoint's tokenizer and chat
template, the Rollouter) answered by a noisy scripted policy: each turn it gives the reference
answer, or drops a name, swaps two, adds a line of chatter or leaves out the tags, so episode
lengths vary the way they do during training. No model runs: this measures packing only.

Baseline on the same episodes: "pad to longest" (one row per episode, all padded to the step's
longest episode: the [batch, max_len] layout).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from results_table import RESULTS, append_row
from rlactors_examples.alphabet_sort.env import AlphabetSortConfig, AlphabetSortEnv, reference_reply

from rlactors.config import BatcherConfig, RolloutConfig
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.models.tokenizer import load_tokenizer
from rlactors.rollout import Batcher, Rollouter, SampleStream
from rlactors.types import Completion

COLUMNS = ("workload", "row_tokens", "rows/microbatch", "DP ranks", "padding (mean)", "padding (worst step)",
           "pad to longest", "pack ms")
LAYOUTS = [  # (row_tokens, rows_per_microbatch, dp ranks)
    (1024, 4, 1),
    (1024, 4, 2),
    (1536, 4, 2),
    (2048, 2, 1),
    (2048, 2, 2),
    (4096, 1, 2),
]


class NoisyPolicy:
    """Reference answers with seeded mistakes, encoded with the real tokenizer."""

    def __init__(self, tok, samples_by_group):
        self.tok, self.samples_by_group = tok, samples_by_group

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        group, _, turn = request_id.split("/")
        sample, k = self.samples_by_group[group], int(turn[1:])
        rng = random.Random(sampling.seed)
        lines = reference_reply(sample, k).split("\n")
        names = lines[1:-1]
        mistake = rng.random()
        if mistake < 0.2 and len(names) > 1:
            names.pop(rng.randrange(len(names)))
        elif mistake < 0.4 and len(names) > 1:
            i, j = rng.sample(range(len(names)), 2)
            names[i], names[j] = names[j], names[i]
        elif mistake < 0.5:
            lines = ["", ""]
        elif mistake < 0.6:
            names.append("I think this is the sorted list of names.")
        text = "\n".join([lines[0], *names, lines[-1]]).strip()
        tokens = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop"
        if len(tokens) > sampling.max_tokens:
            tokens, finish = tokens[:sampling.max_tokens], "length"
        return Completion(request_id, list(prompt), tokens, [-1.0] * len(tokens), [0] * len(tokens), finish)


async def collect_steps(steps: int, tok) -> list[list]:
    env = AlphabetSortEnv(AlphabetSortConfig(seed=0), tok)  # defaults: 1-3 turns, 1-5 names per turn
    config = RolloutConfig(group_size=8, prompts_per_step=8, max_total_tokens=1024, max_tokens_per_turn=256)
    stream = SampleStream(env.dataset("train"), seed=0)
    samples_by_group: dict[str, dict] = {}
    rollouter = Rollouter(env, NoisyPolicy(tok, samples_by_group), config)
    step_episodes = []
    for _ in range(steps):
        samples = stream.next(config.prompts_per_step)
        first = rollouter.state_dict()["groups_started"]
        samples_by_group.update({f"g{first + i}": s for i, s in enumerate(samples)})
        batch = await rollouter.collect(samples)
        step_episodes.append(batch.episodes)
    return step_episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "batcher_padding.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(make_tiny_checkpoint(tmp))
    step_episodes = asyncio.run(collect_steps(args.steps, tok))
    lengths = [len(ep) for eps in step_episodes for ep in eps]

    rows, figures = [], []
    episodes_per_step = statistics.fmean(len(eps) for eps in step_episodes)
    workload = (f"{args.steps} steps, {episodes_per_step:.1f} episodes a step, {statistics.fmean(lengths):.0f} "
                f"tokens mean ({min(lengths)}-{max(lengths)})")
    for row_tokens, rpm, dp in LAYOUTS:
        batcher = Batcher(BatcherConfig(row_tokens=row_tokens, rows_per_microbatch=rpm), dp_size=dp)
        fractions, pack_ms, pad_longest = [], [], []
        for episodes in step_episodes:
            start = time.perf_counter()
            packed = batcher.pack(episodes)
            pack_ms.append(1000 * (time.perf_counter() - start))
            fractions.append(packed.metrics["batcher/padding_fraction"])
            targets = [len(ep) - 1 for ep in episodes]
            pad_longest.append(1 - sum(targets) / (len(targets) * max(targets)))
        rows.append(
            f"| {row_tokens} | {rpm} | {dp} | {statistics.fmean(fractions):.2%} | {max(fractions):.2%} "
            f"| {statistics.fmean(pad_longest):.2%} | {statistics.fmean(pack_ms):.1f} |")
        figures.append([workload, row_tokens, rpm, dp, f"{statistics.fmean(fractions):.2%}", f"{max(fractions):.2%}",
                        f"{statistics.fmean(pad_longest):.2%}", f"{statistics.fmean(pack_ms):.1f}"])
    text = "\n".join([
        "# Batcher padding on alphabet_sort episodes",
        "",
        f"Command: `.venv/bin/python benchmarks/batcher_padding.py --steps {args.steps}`",
        "",
        f"{args.steps} steps of 8 prompts x 8 rollouts (alphabet_sort defaults: 1-3 turns, 1-5 names per turn;",
        "tiny checkpoint tokenizer and ChatML template; noisy scripted answers, see the script).",
        f"Episodes per step: {episodes_per_step:.1f} (groups whose rewards do not vary are dropped, the default);",
        f"episode tokens: mean {statistics.fmean(lengths):.0f}, min {min(lengths)}, max {max(lengths)}.",
        "",
        "Padding fraction = padding slots / all slots of the step's microbatches (every rank, filler",
        "microbatches included). Goal: < 5%. Default layout: row_tokens 1024, 4 rows per microbatch.",
        "Documents never span rows; a microbatch is as wide as its fullest row. pack ms: one",
        "`Batcher.pack` of a step on this machine's CPU.",
        "",
        "| row_tokens | rows/microbatch | DP ranks | padding (mean) | padding (worst step) "
        "| pad to longest | pack ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    for row in figures:
        append_row(args.out, "Batcher padding on alphabet_sort episodes", COLUMNS, row, device="cpu")
    print(f"added {len(figures)} row(s) to {args.out}")


if __name__ == "__main__":
    main()
