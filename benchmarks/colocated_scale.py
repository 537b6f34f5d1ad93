"""Colocated scale: a Qwen3 shape trained with GRPO on GPUs it shares with vLLM, taking turns.

    python benchmarks/colocated_scale.py --size 4b --rollout-tokens 8192            # one H200
    python benchmarks/colocated_scale.py --size 8b --rollout-tokens 2048 --offload --true-on-policy --steps 5
    .venv/bin/python benchmarks/colocated_scale.py --dry-run                          # CPU: the same code, tiny

A run of `python -m rlactors.train`'s controller on one GPU: `controller.colocate`, vLLM with
`generator.sleep` (its engine asleep while the trainer steps), sync mode, on a random-init
checkpoint of the shape (rlactors.models.tiny, kept under --ckpt-root for the next case). Each
rollout is one turn of exactly --rollout-tokens (random weights never stop early) and earns a
random reward (the parity of its tokens' sum), so every group trains. The memory knobs are the
first set the memory plan says fits (none; activation checkpointing; with --offload the
optimizer state offloaded first), and vLLM gets the share of the GPU that the generation phase
leaves (or --gpu-memory-utilization).

It adds one row to results/colocated_scale_gpu.md (--dry-run: _cpu): whether the plan fits, the
planned and measured peaks (the GPU's use as nvidia-smi sees it, every 0.5 s; the trainer's
torch.cuda.max_memory_allocated), and, of the last step (the first compiles), step time, trainer
tokens/s, MFU (trainer_throughput.py's FLOPs over the step's training time) and generation
tokens/s; with --true-on-policy, `loss/logprob_diff/max` of every step.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_table import RESULTS, append_row  # noqa: E402
from trainer_throughput import peak_tflops, train_flops  # noqa: E402

from rlactors.config import Config, load_config  # noqa: E402
from rlactors.models.checkpoint import load_args  # noqa: E402
from rlactors.models.tiny import kept_checkpoint  # noqa: E402
from rlactors.rollout import Observation, StepResult, TokenEnv  # noqa: E402
from rlactors.run.memory_plan import GIB, VLLM_OUTSIDE_SHARE_GIB, gpu_gib, plan  # noqa: E402

PROMPT_TOKENS = 16
GENERATION_MARGIN_GIB = 4.0  # left free in the generation phase when vLLM's share is chosen


class RandomRewardEnv(TokenEnv):
    """One turn from a short prompt of random ids; reward 1 when the completion's token ids sum
    to an even number: rewards vary within every group whatever the policy."""

    def dataset(self, split: str) -> list[int]:
        return list(range(1000))

    async def reset(self, sample: int) -> Observation:
        rng = random.Random(sample)
        return Observation([rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)])

    async def step(self, completion: Any) -> StepResult:
        return StepResult(None, reward=float(sum(completion.token_ids) % 2 == 0), done=True)


def overrides(opts: argparse.Namespace, ckpt: Path, run_dir: Path, knobs: list[str]) -> list[str]:
    total = opts.rollout_tokens + PROMPT_TOKENS
    row = max(opts.row_tokens, -(-total // 1024) * 1024)
    device = ['controller.device="cpu"', 'generator.engine="native"'] if opts.dry_run else \
        ['controller.device="cuda"', 'generator.engine="vllm"', 'model.dtype="bfloat16"']
    return [f'model.path="{ckpt}"', f'controller.run_dir="{run_dir}"', f"controller.steps={opts.steps}",
            *device, "trainer.ranks=1", "generator.replicas=1", "controller.colocate=true", "generator.sleep=true",
            'controller.mode="sync"', "controller.eval_every=0", "controller.log_samples=false",
            "controller.checkpoint_every=0", "trainer.lr=1e-6",
            f"model.true_on_policy={str(opts.true_on_policy).lower()}",
            f"generator.max_model_len={total}", f"generator.kv_cache_tokens={4 * total}", "generator.max_num_seqs=64",
            "generator.max_num_tokens=8192",
            f"rollout.max_total_tokens={total}", f"rollout.max_tokens_per_turn={opts.rollout_tokens}",
            "rollout.max_turns=1", f"rollout.prompts_per_step={opts.prompts}", f"rollout.group_size={opts.group_size}",
            "rollout.keep_zero_variance_groups=true", f"batcher.row_tokens={row}", "batcher.rows_per_microbatch=1",
            f"env.name={Path(__file__).stem}:RandomRewardEnv", *knobs]


def fitting_config(opts: argparse.Namespace, ckpt: Path, run_dir: Path) -> tuple[Config, list[str], Any]:
    """The config with the first set of memory knobs whose plan fits (the last tried when none does),
    vLLM given what the generation phase leaves; its knobs and plan."""
    offload = ["trainer.offload_optimizer=true"]
    tries = [offload, [*offload, "trainer.activation_checkpointing=true"]] if opts.offload else \
        [[], ["trainer.activation_checkpointing=true"]]
    args = load_args(ckpt)
    for knobs in tries:
        config = load_config(None, overrides(opts, ckpt, run_dir, knobs), available_gpus=1)
        gpu = gpu_gib(config) or opts.gpu_gib
        if not opts.dry_run:
            share = opts.gpu_memory_utilization
            if share is None:  # what the generation phase leaves: the trainer's resident memory and a margin
                resident = plan(config, args, gpu).trainer.resident / GIB
                share = round(min(0.85, (gpu - resident - VLLM_OUTSIDE_SHARE_GIB - GENERATION_MARGIN_GIB) / gpu), 2)
            knobs = [*knobs, f"generator.gpu_memory_utilization={share}"]
            config = load_config(None, overrides(opts, ckpt, run_dir, knobs), available_gpus=1)
        memory = plan(config, args, gpu)
        if not memory.problems():
            break
    return config, knobs, memory


class GpuMemoryPoll:
    """The most memory the first visible GPU held while running, as nvidia-smi reports it (all
    processes)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib, self._stop = every_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                  os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                self.peak_mib = max(self.peak_mib, float(out.stdout.split()[0]))
            self._stop.wait(self.every_s)

    def __enter__(self) -> GpuMemoryPoll:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def run(config: Config) -> tuple[list[dict[str, float]], str]:
    """The run's step metrics, and how it ended ("ok", or the error's first line)."""
    from rlactors.procs.supervision import use_fast_supervision
    from rlactors.run.controller import Controller
    from rlactors.train import run_controller

    use_fast_supervision()
    controller = Controller(config)

    async def no_checkpoint() -> None:
        """The run's last step saves no checkpoint: one (fp32 weights, AdamW's state and the
        policy in bf16: 56 GB at 4B) would fill the device's disk, and the benchmark times steps."""

    controller.save_checkpoint = no_checkpoint
    try:
        return run_controller(controller), "ok"
    except Exception as e:  # noqa: BLE001 - an OOM or a failed step is a result of this benchmark
        return [], " ".join(f"{type(e).__name__}: {e}".split())[:200]


COLUMNS = ("model", "rollout tokens", "knobs", "plan fits", "ran", "planned GPU peak (GiB)",
           "measured GPU peak (GiB)", "planned trainer peak (GiB)", "measured trainer peak (GiB)", "step (s)",
           "trainer tokens/s", "MFU", "generation tokens/s", "loss/logprob_diff/max per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default=None, help="a Qwen3 shape: 0.6b, 1.7b, 4b, 8b, 14b, 32b (--dry-run: tiny)")
    parser.add_argument("--rollout-tokens", type=int, default=None, help="tokens per rollout (--dry-run: 48)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=16384, help="at least (a rollout's tokens fit one row)")
    parser.add_argument("--offload", action="store_true", help="trainer.offload_optimizer")
    parser.add_argument("--true-on-policy", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share (default: chosen)")
    parser.add_argument("--gpu-gib", type=float, default=139.8, help="the GPU's memory where none is seen (--dry-run)")
    parser.add_argument("--ckpt-root", type=Path, default=Path(tempfile.gettempdir()) / "rlactors_scale_checkpoints")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the tiny shape, the native engine, 2 steps")
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    if opts.dry_run:
        opts.size, opts.rollout_tokens = opts.size or "tiny", opts.rollout_tokens or 48
        opts.prompts, opts.group_size, opts.row_tokens = 2, 2, 256
    elif opts.size is None or opts.rollout_tokens is None:
        parser.error("--size and --rollout-tokens are needed (or --dry-run)")
    device = "cpu" if opts.dry_run else "cuda"
    out = opts.out or RESULTS / f"colocated_scale_{'cpu' if opts.dry_run else 'gpu'}.md"
    ckpt = kept_checkpoint(opts.ckpt_root, opts.size)
    run_dir = Path(tempfile.mkdtemp(prefix=f"rlactors_scale_{opts.size}_{opts.rollout_tokens}_"))
    config, knobs, memory = fitting_config(opts, ckpt, run_dir)
    print(memory.table(), flush=True)
    fits = not memory.problems()
    history, ended = [], "not run: the plan does not fit"
    poll = GpuMemoryPoll() if device == "cuda" else None
    if fits:
        start = time.perf_counter()
        if poll is not None:
            with poll:
                history, ended = run(config)
        else:
            history, ended = run(config)
        print(f"ran {len(history)} steps in {time.perf_counter() - start:.0f} s: {ended}", flush=True)
    _, trainer, generator = memory.needed
    last = history[-1] if history else {}
    cells = {"step": "-", "tokens": "-", "mfu": "-", "generation": "-"}
    if last:
        args = load_args(ckpt)
        trained = last.get("batcher/tokens", 0.0)
        episode = opts.rollout_tokens + PROMPT_TOKENS
        flops = train_flops(args, [episode] * round(trained / episode))
        peak = peak_tflops(None) if device == "cuda" else None
        generated = last["throughput/generated_tokens_per_s"] * last["time/step_s"]
        cells = {"step": f"{last['time/step_s']:.1f}", "tokens": f"{trained / last['time/train_s']:,.0f}",
                 "mfu": f"{100 * flops / last['time/train_s'] / (peak * 1e12):.1f}%" if peak else "n/a",
                 "generation": f"{generated / last['time/rollout_wait_s']:,.0f}"}
    measured_trainer = max((m.get("memory/trainer_peak_gib", 0.0) for m in history), default=0.0)
    diffs = [m.get("loss/logprob_diff/max", math.nan) for m in history] if opts.true_on_policy else []
    setup = [k.split("=")[0] for k in knobs if k.endswith("true")]
    setup.append(f"gpu_memory_utilization {config.generator.gpu_memory_utilization:g}")
    if opts.true_on_policy:
        setup.append("true on-policy")
    row = append_row(out, "Colocated scale: trainer and vLLM taking turns on one GPU", COLUMNS, [
        f"qwen3 {opts.size}", opts.rollout_tokens, "; ".join(setup),
        "yes" if fits else "no", f"{len(history)} steps, {ended}", f"{(trainer + generator) / GIB:.1f}",
        f"{poll.peak_mib / 1024:.1f}" if poll is not None and poll.peak_mib else "n/a",
        f"{(memory.trainer.peak - memory.trainer.context) / GIB:.1f}",
        f"{measured_trainer:.1f}" if device == "cuda" else "n/a", cells["step"], cells["tokens"], cells["mfu"],
        cells["generation"], " ".join(f"{d:g}" for d in diffs) or "-"], device=device)
    print(row, flush=True)
    sys.exit(0 if ended == "ok" or not fits else 1)


if __name__ == "__main__":
    main()
