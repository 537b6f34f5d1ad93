"""Warm start for the CPU demo: supervised fine-tuning of a random tiny Qwen3 on a careless teacher.

A randomly initialised model never writes a tagged list, so every rollout would score 0 and GRPO
would have no signal. A short SFT phase on demonstrations teaches the format and some sorting.
The demonstrations come from a careless teacher, as real SFT data often does: in 40% of its turns
it forgets the answer tags (a reply the env scores 0) and in 20% it leaves the names unsorted. The
warm policy imitates that mix, so its samples score well below its best replies, and RL has to
find from the reward alone that tagged, sorted replies pay. The run is deterministic: the same
arguments give the same checkpoint, so the committed ones can be rebuilt with

    python examples/alphabet_sort/warm_start.py examples/alphabet_sort/warm_checkpoint
    python examples/alphabet_sort/warm_start.py examples/alphabet_sort/warm_checkpoint_gpu --untagged 0.7 --unsorted 0
    python examples/alphabet_sort/warm_start.py examples/alphabet_sort/warm_checkpoint_moe --family qwen3_moe \
        --untagged 0.7 --unsorted 0

The first is the CPU demo's start; the second, the GPU demo's, mostly forgets the tags, so its
greedy replies score low until RL teaches it to tag (`--untagged`, `--unsorted`: the teacher's
mistake rates). The third is the second's tiny mixture of experts (configs/moe_1gpu.toml).
Arguments after the output dir are `env.args` overrides (`max_turns=2`) for the demonstrations.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rlactors_examples.alphabet_sort.env import (
    COMBINED_TAG,
    FIRST_TAG,
    AlphabetSortConfig,
    build_dataset,
    reference_reply,
)

from rlactors.config import BatcherConfig, LossConfig, build_dataclass, parse_override
from rlactors.models import extend_with_messages, from_pretrained, load_tokenizer, render_messages, save_pretrained
from rlactors.models.args import FAMILIES
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.types import Episode, RolloutStatus
from rlactors.trainer.losses import LossNorm, compute_loss

# The demo task: the difficulty a 1M-parameter model learns on a 2-core CPU in minutes.
DEMO_ENV_ARGS = {"max_turns": 2, "max_names_per_turn": 3}
TEACHER_UNTAGGED = 0.4  # share of demonstrated turns without the answer tags
TEACHER_UNSORTED = 0.2  # share of demonstrated turns with the names in random order


def teacher_reply(sample: dict, turn: int, rng: random.Random, untagged: float = TEACHER_UNTAGGED,
                  unsorted: float = TEACHER_UNSORTED) -> str:
    """The careless teacher's reply to `turn`: the reference, or one of its two mistakes, made in
    `untagged` and `unsorted` of its turns."""
    draw = rng.random()
    if draw >= untagged + unsorted:
        return reference_reply(sample, turn)
    lines = list(sample["expected"][turn])
    if draw < untagged:
        return "\n".join(lines)
    rng.shuffle(lines)
    tag = FIRST_TAG if turn == 0 else COMBINED_TAG
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def demonstration(tokenizer, sample: dict, rng: random.Random, untagged: float = TEACHER_UNTAGGED,
                  unsorted: float = TEACHER_UNSORTED) -> Episode:
    """The whole multi-turn conversation with the teacher's replies; the replies are the loss tokens."""
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    token_ids = render_messages(tokenizer, [{"role": "user", "content": sample["prompts"][0]}])
    loss_mask = [False] * len(token_ids)
    for turn in range(sample["num_turns"]):
        if turn > 0:
            user = {"role": "user", "content": sample["prompts"][turn]}
            extended = extend_with_messages(tokenizer, token_ids, [user])
            loss_mask += [False] * (len(extended) - len(token_ids))
            token_ids = extended
        reply = tokenizer.encode(teacher_reply(sample, turn, rng, untagged, unsorted),
                                 add_special_tokens=False) + [end_of_turn]
        token_ids = token_ids + reply
        loss_mask += [True] * len(reply)
    return sft_episode(token_ids, loss_mask, group_id=str(sample["id"]))


def sft_episode(token_ids: list[int], loss_mask: list[bool], group_id: str = "sft") -> Episode:
    """A demonstration as an Episode for `train`; `loss_mask` marks the teacher's tokens."""
    n = len(token_ids)
    return Episode(token_ids=token_ids, loss_mask=loss_mask, generator_logprobs=[0.0] * n, advantages=[0.0] * n,
                   versions=[-1] * n, group_id=group_id, rollout_index=0, branch=0, reward=0.0,
                   status=RolloutStatus.COMPLETED)


Batch = list[tuple[torch.Tensor, ...]]  # microbatches of flat (input ids, positions, target ids, loss mask)


def packed_rows(episodes: list[Episode]) -> Callable[[list[int]], Batch]:
    """A batch of `episodes` (by index) packed into rows as the trainer packs them, 4 rows a microbatch."""
    batcher = Batcher(BatcherConfig(row_tokens=1024, rows_per_microbatch=4))

    def batch(picked: list[int]) -> Batch:
        return [(mb.input_ids.flatten(), mb.positions.flatten(), mb.target_ids.flatten(), mb.loss_mask.flatten())
                for mb in batcher.pack([episodes[i] for i in picked]).per_rank[0]]
    return batch


def gathered(episodes: list[Episode], device: torch.device) -> Callable[[list[int]], Batch]:
    """A batch of `episodes` (by index) as one flat microbatch, gathered on `device` from their tokens
    put there once: on a GPU, packing rows in Python costs more than a small model's step."""
    tokens = torch.tensor([t for e in episodes for t in e.token_ids], device=device)
    loss_mask = torch.tensor([m for e in episodes for m in e.loss_mask], device=device)
    lengths = torch.tensor([len(e) for e in episodes], device=device)
    starts = lengths.cumsum(0) - lengths

    def batch(picked: list[int]) -> Batch:
        index = torch.tensor(picked, device=device)
        inputs = lengths[index] - 1  # an episode's inputs: every token but its last
        doc = torch.repeat_interleave(torch.arange(len(picked), device=device), inputs)
        positions = torch.arange(doc.numel(), device=device) - (inputs.cumsum(0) - inputs)[doc]
        source = starts[index][doc] + positions
        return [(tokens[source], positions, tokens[source + 1], loss_mask[source + 1])]
    return batch


def train(model, episodes: list[Episode], steps: int, batch_size: int, lr: float, seed: int,
          stop: Callable[[int], bool] | None = None) -> int:
    """SFT of `model` on `episodes` for `steps` steps, or until `stop(step)`, asked after each
    step, says so; returns the last step taken."""
    device = next(model.parameters()).device
    batches = packed_rows(episodes) if device.type == "cpu" else gathered(episodes, device)
    # On a GPU a whole batch's logits at once (a tiny vocabulary): fewer kernels a step.
    chunk_size = 1024 if device.type == "cpu" else 1 << 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order = torch.randperm(len(episodes), generator=torch.Generator().manual_seed(seed)).tolist()
    sft = LossConfig(name="sft")
    start = time.monotonic()
    for step in range(1, steps + 1):
        microbatches = batches([order[(step * batch_size + i) % len(order)] for i in range(batch_size)])
        norm = LossNorm(num_tokens=sum(int(mask.sum()) for *_, mask in microbatches))
        total = 0.0
        for input_ids, positions, target_ids, mask in microbatches:
            input_ids, positions, target_ids, mask = (t.to(device) for t in (input_ids, positions, target_ids, mask))
            # sdpa: the flash backends take fp16/bf16 only, and these weights are fp32 on any device
            hidden = model.forward_packed(input_ids, positions, backend="sdpa")
            logprobs = model.token_logprobs(hidden, target_ids, chunk_size)
            zeros = torch.zeros_like(logprobs)  # SFT: no advantages, no generator logprobs
            loss, _ = compute_loss(sft, norm, logprobs, mask, zeros, zeros)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps:
            print(f"sft step {step:>4}/{steps}  loss {total:.4f}  {time.monotonic() - start:.0f}s", flush=True)
        if stop is not None and stop(step):
            return step
    return steps


def warm_start_main(doc: str, default_steps: int, demonstrations: Callable[[Any, argparse.Namespace], list[Episode]],
                    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                    stop_when: Callable[[Any, Any, argparse.Namespace], Callable[[int], bool] | None] | None = None,
                    argv: list[str] | None = None) -> None:
    """The command line of a warm start of a tiny Qwen3, `OUT_DIR [--size --steps --batch-size
    --lr --seed --device]` and the example's own options (`add_arguments`): SFT on
    `demonstrations(tokenizer, args)`, stopped early where `stop_when(model, tokenizer, args)`
    gives a `train` stop; on the CPU on one thread (a reproducible checkpoint). It is
    built in `OUT_DIR.partial` and its files moved into OUT_DIR when done: a run cut short leaves no
    checkpoint of random weights where a config expects a trained one."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32: fp32 matmuls would make the GPU's steps compute-bound
    start = time.monotonic()
    partial = args.out_dir.with_name(args.out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make_tiny_checkpoint(partial, size=args.size, seed=args.seed)
    tokenizer = load_tokenizer(partial)
    model = from_pretrained(partial, dtype=torch.float32, device=args.device)
    episodes = demonstrations(tokenizer, args)
    print(f"{len(episodes)} demonstrations, {sum(len(e) for e in episodes)} tokens", flush=True)
    stop = None if stop_when is None else stop_when(model, tokenizer, args)
    steps = train(model, episodes, args.steps, args.batch_size, args.lr, args.seed, stop)
    save_pretrained(model.cpu(), model.args, partial)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in partial.iterdir():
        path.replace(args.out_dir / path.name)
    partial.rmdir()
    print(f"wrote {args.out_dir} ({steps} steps) in {time.monotonic() - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("env_args", nargs="*", help="env.args overrides for the demonstrations, e.g. max_turns=2")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untagged", type=float, default=TEACHER_UNTAGGED,
                        help="share of the teacher's turns without the answer tags")
    parser.add_argument("--unsorted", type=float, default=TEACHER_UNSORTED,
                        help="share of the teacher's turns with the names in random order")
    args = parser.parse_args()
    if not (0 <= args.untagged and 0 <= args.unsorted and args.untagged + args.unsorted <= 1):
        parser.error("--untagged and --unsorted must be >= 0 and add up to at most 1")

    env_args = dict(DEMO_ENV_ARGS)
    for text in args.env_args:
        keys, value = parse_override(text)
        env_args[".".join(keys)] = value
    env_config = build_dataclass(AlphabetSortConfig, env_args, "env.args")

    # One thread: the same reduction order on any machine, so the checkpoint is reproducible.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    make_tiny_checkpoint(args.out_dir, size=args.size, seed=args.seed, family=args.family)
    tokenizer = load_tokenizer(args.out_dir)
    model = from_pretrained(args.out_dir, dtype=torch.float32)
    teacher_rng = random.Random(args.seed)
    episodes = [demonstration(tokenizer, s, teacher_rng, args.untagged, args.unsorted)
                for s in build_dataset(env_config, "train")]
    print(f"{len(episodes)} demonstrations, {sum(len(e) for e in episodes)} tokens", flush=True)
    train(model, episodes, args.steps, args.batch_size, args.lr, args.seed)
    save_pretrained(model, model.args, args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
