"""Where a trainer step's GPU time goes, default mode against true on-policy with vLLM (GPU, vLLM
installed): the on_policy_cost.py workload's episodes (random completions of the same lengths),
one microbatch's forward and backward timed with CUDA events, then profiled, kernels grouped.

    python benchmarks/device/trainer_profile.py [--size 0.6b] [--top 25]

Prints per mode: forward ms, forward+backward ms, and the top kernels by GPU time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import on_policy_cost as opc  # noqa: E402


def completions(num: int, model_vocab: int, new_tokens: int = 128) -> list[dict]:
    prompts = opc.make_prompts(num, 16, 512, model_vocab)
    g = torch.Generator().manual_seed(1)
    return [{"prompt": p, "tokens": torch.randint(3, model_vocab, (new_tokens,), generator=g).tolist(),
             "logprobs": [-1.0] * new_tokens} for p in prompts]


def timed(fn, repeats: int = 3) -> float:
    """Best milliseconds of fn over repeats (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="0.6b")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    from rlactors.config import BatcherConfig, LossConfig
    from rlactors.models.checkpoint import load_args
    from rlactors.models.tiny import make_tiny_checkpoint
    from rlactors.rollout.batcher import Batcher
    from rlactors.trainer.losses import LossNorm

    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / args.size, size=args.size, seed=0, dtype="bfloat16")
    vocab = load_args(ckpt).vocab_size
    opc.init_one_rank("cuda")
    packed = Batcher(BatcherConfig(row_tokens=4096, rows_per_microbatch=4)).pack(
        opc.episodes_of(completions(256, vocab)))
    microbatches = packed.per_rank[0]
    mb = microbatches[0]
    loss = LossConfig(name="grpo")
    norm = LossNorm.for_step(microbatches, loss.name)
    bench_args = argparse.Namespace(device="cuda", dtype="bfloat16")
    for mode, true_on_policy in (("default", False), ("true_on_policy (vLLM)", True)):
        core = opc.make_core(bench_args, ckpt, true_on_policy, "vllm" if true_on_policy else "native")
        forward = timed(lambda core=core: core.compute_logprobs([mb]))
        step = timed(lambda core=core: core.forward_backward([mb], norm, loss))
        print(f"\n== {mode}: microbatch of {mb.input_ids.numel()} tokens: forward {forward:.1f} ms, "
              f"forward+backward {step:.1f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            core.forward_backward([mb], norm, loss)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events)
        print(f"GPU kernel time {total / 1e3:.1f} ms; top kernels (self time):")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms {100 * e.self_device_time_total / total:5.1f}% "
                  f"x{e.count:<5d} {e.key[:110]}")
        core.optimizer.zero_grad(set_to_none=True)
        del core
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
