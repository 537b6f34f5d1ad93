"""Where a vLLM generation's GPU time goes, default mode against true on-policy (issue #18).

The workload of `benchmarks/on_policy_cost.py --device cuda` (256 prompts of 16-512 tokens, 128
sampled tokens each, 64 sequences a step, random Qwen3-shaped bf16 weights). Each mode runs in a
process of its own (vLLM reads its mode at import): a warm-up pass, a timed pass, then a pass on
the same prompts under torch.profiler. Prints, per mode, the wall time, engine steps, the GPU
kernel time per step, and the kernels that took the most time.

    python benchmarks/device/generation_profile.py [--size 0.6b] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def generate(engine, prompts, max_tokens: int, tag: str) -> tuple[float, int]:
    from rlactors.types import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def profile_mode(args) -> dict:
    import torch
    from on_policy_cost import make_prompts
    from torch.autograd import DeviceType

    from rlactors.config import GeneratorConfig, ModelConfig
    from rlactors.engines.vllm_engine import VLLMEngine
    from rlactors.models.checkpoint import load_args

    prompts = make_prompts(256, 16, 512, load_args(args.ckpt).vocab_size)
    engine = VLLMEngine.from_config(
        GeneratorConfig(engine="vllm", max_num_seqs=64, max_num_tokens=2048, max_model_len=2048,
                        gpu_memory_utilization=0.4),
        ModelConfig(path=args.ckpt, dtype="bfloat16", true_on_policy=args.mode == "true_on_policy"))
    generate(engine, prompts, 128, "warm")
    seconds, steps = generate(engine, prompts, 128, "timed")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        profiled_seconds, profiled_steps = generate(engine, prompts, 128, "profiled")
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels[event.name][0] += event.device_time_total
            kernels[event.name][1] += 1
    engine.close()
    return {"seconds": seconds, "steps": steps, "profiled_seconds": profiled_seconds,
            "profiled_steps": profiled_steps,
            "kernels": sorted(([name, us, n] for name, (us, n) in kernels.items()), key=lambda k: -k[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.6b")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--mode", choices=("default", "true_on_policy"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        Path(args.out_json).write_text(json.dumps(profile_mode(args)))
        return
    from rlactors.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / args.size, size=args.size, seed=0, dtype="bfloat16")
        results = {}
        for mode in ("default", "true_on_policy"):
            out = Path(tmp) / f"{mode}.json"
            subprocess.run([sys.executable, __file__, "--mode", mode, "--ckpt", str(ckpt), "--out-json", str(out)],
                           check=True)
            results[mode] = json.loads(out.read_text())
    for mode, r in results.items():
        kernel_us = sum(k[1] for k in r["kernels"])
        steps = r["profiled_steps"]
        print(f"\n== {mode} ({args.size}): {r['seconds']:.3f} s for {r['steps']} steps "
              f"({1e3 * r['seconds'] / r['steps']:.2f} ms/step); under the profiler {r['profiled_seconds']:.3f} s; "
              f"GPU kernel time {kernel_us / steps / 1e3:.3f} ms/step, "
              f"{sum(k[2] for k in r['kernels']) / steps:.0f} kernels/step")
        for name, us, n in r["kernels"][:args.top]:
            print(f"  {us / steps:8.1f} us/step {n / steps:6.1f}/step {100 * us / kernel_us:5.1f}%  {name[:110]}")
    default, true = (results[m]["seconds"] for m in ("default", "true_on_policy"))
    print(f"\ntrue on-policy / default wall time: {true / default:.3f}x")


if __name__ == "__main__":
    main()
