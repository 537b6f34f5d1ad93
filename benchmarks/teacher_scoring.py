"""Distillation's cost: the teacher's scoring throughput, and a training step with the teacher's
scoring against GRPO alone on the same batches.

    python benchmarks/teacher_scoring.py --device cuda                  # 1.7B teacher, 0.6B student
    .venv/bin/python benchmarks/teacher_scoring.py --teacher small --student tiny --row-tokens 512

It drives the code inside the actors directly, on one device: PolicyTrainerCore (the student) and
TeacherScorer (rlactors.trainer.teacher), random-init checkpoints of each shape
(rlactors.models.tiny; the shapes share one tokenizer). A step is `--microbatches` packed
microbatches (trainer_throughput.py's), forward_backward each, then optim_step; distilled, the
teacher scores each microbatch first (`teacher.path`, in `model.dtype`). On one device the two
take turns, so the distilled step's time is scoring plus training: the cost where the teacher is
colocated with the trainer. Adds a row to results/teacher_scoring_{cpu,gpu}.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from results_table import RESULTS, append_row
from trainer_throughput import join_process_group, packed_microbatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlactors.config import LossConfig, ModelConfig, TeacherConfig, TrainerConfig  # noqa: E402
from rlactors.models.checkpoint import load_args  # noqa: E402
from rlactors.models.tiny import kept_checkpoint  # noqa: E402
from rlactors.on_policy.sides import sides  # noqa: E402
from rlactors.trainer.core import PolicyTrainerCore  # noqa: E402
from rlactors.trainer.losses import LossNorm  # noqa: E402
from rlactors.trainer.teacher import TeacherScorer  # noqa: E402

COLUMNS = ("teacher", "student", "setup", "tokens/step", "teacher scoring (tokens/s)", "GRPO step (s)",
           "distilled step (s)", "of which scoring (s)", "distilled / GRPO")


def timed(device: torch.device, work) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def train_step(core: PolicyTrainerCore, mbs: list) -> dict[str, float]:
    loss = LossConfig(name="grpo")
    norm = LossNorm.for_step(mbs, loss.name)
    for mb in mbs:
        core.forward_backward([mb], norm, loss)
    return core.optim_step()


def train_steps(core: PolicyTrainerCore, steps: list, device: torch.device, warmup: int) -> float:
    """The mean seconds of the steps after `warmup`."""
    times = []
    for i, mbs in enumerate(steps):
        seconds, metrics = timed(device, functools.partial(train_step, core, mbs))
        if metrics["update_skipped"]:
            raise RuntimeError(f"step {i} skipped its update (grad norm {metrics['grad_norm']})")
        times += [seconds] if i >= warmup else []
    return sum(times) / len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--teacher", default="1.7b")
    parser.add_argument("--student", default="0.6b")
    parser.add_argument("--row-tokens", type=int, default=8192)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=[256, 2048], metavar=("MIN", "MAX"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ckpt-root", type=Path, default=Path(tempfile.gettempdir()) / "rlactors_bench_ckpts")
    opts = parser.parse_args()
    device = join_process_group(opts.device)
    cuda = device.type == "cuda"
    print(f"checkpoints under {opts.ckpt_root} (made where missing): {opts.teacher}, {opts.student}", flush=True)
    teacher_ckpt, student_ckpt = (kept_checkpoint(opts.ckpt_root, size) for size in (opts.teacher, opts.student))
    dtype = "bfloat16" if cuda else "float32"
    model = ModelConfig(path=str(student_ckpt), dtype=dtype)
    trainer = TrainerConfig(ranks=1, lr=1e-6, mixed_precision=cuda, compile_layers=cuda)
    kernels = sides(False, "native", device).trainer
    generator = torch.Generator().manual_seed(0)
    vocab = load_args(student_ckpt).vocab_size
    steps = [[packed_microbatch(1, opts.row_tokens, tuple(opts.doc_tokens), vocab, generator)[0]
              for _ in range(opts.microbatches)] for _ in range(opts.warmup + opts.steps)]
    tokens = opts.microbatches * opts.row_tokens

    print(f"GRPO alone: {opts.warmup} warmup + {opts.steps} timed steps of {tokens} tokens", flush=True)
    core = PolicyTrainerCore(model, trainer, device, kernels)
    for mbs in steps:  # on policy: ratio 1, as trainer_throughput.py
        for mb in mbs:
            mb.generator_logprobs = core.compute_logprobs([mb])
    grpo_s = train_steps(core, steps, device, opts.warmup)
    print(f"GRPO: {grpo_s:.3f} s/step", flush=True)
    del core

    teacher = TeacherConfig(path=str(teacher_ckpt))
    scorer = TeacherScorer(teacher, model, device, kernels, trainer.logprob_chunk_tokens)
    score_times = []
    for i in range(len(steps)):
        seconds, steps[i] = timed(device, functools.partial(scorer.score, steps[i]))
        score_times += [seconds] if i >= opts.warmup else []
    score_s = sum(score_times) / len(score_times)
    print(f"teacher: {tokens / score_s:,.0f} tokens/s, {score_s:.3f} s/step", flush=True)
    del scorer
    if cuda:
        torch.cuda.empty_cache()
    distilled_s = train_steps(PolicyTrainerCore(model, trainer, device, kernels, teacher=teacher), steps, device,
                              opts.warmup) + score_s
    print(f"distilled: {distilled_s:.3f} s/step ({distilled_s / grpo_s:.2f}x GRPO)", flush=True)

    setup = (f"{dtype}; layers {'compiled' if trainer.compile_layers else 'eager'}; {opts.microbatches} x 1 x "
             f"{opts.row_tokens} tokens, documents of {opts.doc_tokens[0]}-{opts.doc_tokens[1]}; {opts.steps} timed "
             f"steps after {opts.warmup}; one device, teacher and student taking turns")
    out = RESULTS / f"teacher_scoring_{'gpu' if cuda else 'cpu'}.md"
    append_row(out, "Distillation's cost: teacher scoring and the step against GRPO alone", COLUMNS,
               [opts.teacher, opts.student, setup, tokens, f"{tokens / score_s:,.0f}", f"{grpo_s:.3f}",
                f"{distilled_s:.3f}", f"{score_s:.3f}", f"{distilled_s / grpo_s:.2f}"], device=opts.device)
    print(f"added a row to {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
