"""Colocated scale: Qwen3 shapes trained with GRPO on one GPU they share with vLLM, taking turns.

    python benchmarks/colocated_scale.py --size 4b --rollout-tokens 8192            # one case, one H200
    python benchmarks/colocated_scale.py --cells 1.7b:2048 4b:2048 4b:2048:5:onpolicy --budget-s 720
    .venv/bin/python benchmarks/colocated_scale.py --dry-run                          # CPU: the same code, tiny

A case is a run of `python -m rlactors.train`'s controller on one GPU: `controller.colocate`, vLLM
with `generator.sleep`, sync mode, on a random-init checkpoint of the shape (rlactors.models.tiny,
kept under --ckpt-root for the next case). Each rollout is one turn of exactly --rollout-tokens
(random weights never stop early) and earns a random reward (the parity of its tokens' sum). A
step trains on about 131k tokens (8 x 16384, as trainer_throughput.py measures MFU): the prompts
per step follow the rollout length, and a packed row holds as many whole rollouts as fit in
--row-tokens. The memory knobs are the first set the memory plan says fits with MARGIN_GIB spare
(none; activation checkpointing; the optimizer offloaded; both), and vLLM gets the share whose KV
cache (sized by the plan) holds a step's rollouts at once, or the largest the plan leaves with
MARGIN_GIB spare in every phase when that is less (or --gpu-memory-utilization).

`--cells SIZE:TOKENS[:STEPS][:onpolicy] ...` runs cases one after another, each in its own process
within what is left of --budget-s; a case that ends without its row (killed at the budget, or
crashed) gets one saying so. Each case adds one row to results/colocated_scale_gpu.md (--dry-run:
_cpu): whether the plan fits (a case it refuses is not run), planned and measured GPU peaks
(nvidia-smi, every 0.5 s) and trainer peaks (max allocated), and, of the last step (the first
compiles), step time, trainer tokens/s and MFU over the trainer's phase alone (forward, backward,
optimizer step), generation tokens/s; in true on-policy mode `loss/logprob_diff/max` of every step.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
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
from rlactors.run.memory_plan import GIB, gpu_gib, gpu_processes, plan  # noqa: E402

PROMPT_TOKENS = 16
# GiB left free in every phase of the plan when the knobs and vLLM's share are chosen: more than
# the plan has missed any measured peak by (results/notes/colocated_scale.md)
MARGIN_GIB = 14.0
STEP_TOKENS = 8 * 16384  # a step's tokens: trainer_throughput.py's step, where MFU was measured


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


def prompts_per_step(opts: argparse.Namespace) -> int:
    """--prompts, else as many as make a step of about STEP_TOKENS."""
    return opts.prompts or max(1, STEP_TOKENS // (opts.group_size * (opts.rollout_tokens + PROMPT_TOKENS)))


def overrides(opts: argparse.Namespace, ckpt: Path, run_dir: Path, knobs: list[str]) -> list[str]:
    total = opts.rollout_tokens + PROMPT_TOKENS
    # rows of as many whole rollouts as --row-tokens holds: every rollout here is `total` tokens
    # long, so a longer row would never fill, and the plan sizes activations by the row
    row = max(total, opts.row_tokens // total * total)
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
            "rollout.max_turns=1", f"rollout.prompts_per_step={prompts_per_step(opts)}",
            f"rollout.group_size={opts.group_size}", "rollout.keep_zero_variance_groups=true",
            f"batcher.row_tokens={row}", "batcher.rows_per_microbatch=1",
            f"env.name={Path(__file__).stem}:RandomRewardEnv", *opts.set, *knobs]


def fitting_config(opts: argparse.Namespace, ckpt: Path, run_dir: Path) -> tuple[Config, list[str], Any]:
    """The config with the first set of memory knobs whose plan fits with MARGIN_GIB to spare (the
    last tried when none does), vLLM given the share its rollouts need (`needed_share`) or the
    largest the plan leaves with that margin, whichever is less; its knobs and plan."""
    offload, checkpointing = "trainer.offload_optimizer=true", "trainer.activation_checkpointing=true"
    tries = [[offload], [offload, checkpointing]] if opts.offload else \
        [[], [checkpointing], [offload], [offload, checkpointing]]
    args = load_args(ckpt)
    for knobs in tries:
        config = load_config(None, overrides(opts, ckpt, run_dir, knobs), available_gpus=1)
        gpu = gpu_gib(config) or opts.gpu_gib
        if not opts.dry_run:
            share = opts.gpu_memory_utilization
            if share is None:
                memory = plan(config, args, gpu)
                share = min(0.85, needed_share(memory), memory.largest_share(MARGIN_GIB))
            knobs = [*knobs, f"generator.gpu_memory_utilization={max(share, 0.01):g}"]
            config = load_config(None, overrides(opts, ckpt, run_dir, knobs), available_gpus=1)
        memory = plan(config, args, gpu)
        if not plan(config, args, gpu - MARGIN_GIB).problems():
            break
    return config, knobs, memory


def needed_share(memory: Any) -> float:
    """The gpu_memory_utilization whose KV cache holds every rollout of a step at once (at most
    `generator.max_num_seqs`, of `generator.max_model_len` tokens): a larger cache serves them no
    faster."""
    c = memory.config
    rollouts = c.rollout.prompts_per_step * c.rollout.group_size
    return memory.share_holding(min(c.generator.max_num_seqs, rollouts) * c.generator.max_model_len)


class GpuMemoryPoll:
    """The most memory the first visible GPU held while running, as nvidia-smi reports it (all
    processes), and each process's share at that moment (`at_peak`, as nvidia-smi lists them)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib, self.at_peak, self._stop = every_s, 0.0, "", threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() and float(out.stdout.split()[0]) > self.peak_mib:
                self.peak_mib = float(out.stdout.split()[0])
                self.at_peak = "; ".join(f"{pid}, {mib} MiB ({command[:80]})"
                                         for pid, (mib, command) in gpu_processes(gpu).items())
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
           "trainer tokens/s", "trainer MFU (train phase)", "generation tokens/s", "loss/logprob_diff/max per step")
TITLE = "Colocated scale: trainer and vLLM taking turns on one GPU"


def results_file(opts: argparse.Namespace) -> Path:
    return opts.out or RESULTS / f"colocated_scale_{'cpu' if opts.dry_run else 'gpu'}.md"


def run_case(opts: argparse.Namespace) -> int:
    """One case (--size, --rollout-tokens): its row; the exit code."""
    device = "cpu" if opts.dry_run else "cuda"
    ckpt = kept_checkpoint(opts.ckpt_root, opts.size)
    run_dir = Path(tempfile.mkdtemp(prefix=f"rlactors_scale_{opts.size}_{opts.rollout_tokens}_"))
    config, knobs, memory = fitting_config(opts, ckpt, run_dir)
    print(memory.table(), flush=True)
    fits = not memory.problems()
    history, ended = [], "not run: the plan refuses"
    poll = GpuMemoryPoll() if device == "cuda" else None
    if fits:
        start = time.perf_counter()
        if poll is not None:
            with poll:
                history, ended = run(config)
        else:
            history, ended = run(config)
        print(f"ran {len(history)} steps in {time.perf_counter() - start:.0f} s: {ended}", flush=True)
        if poll is not None:
            print(f"GPU peak {poll.peak_mib:.0f} MiB; by process then: {poll.at_peak or 'not listed'}", flush=True)
        for step, metrics in enumerate(history, 1):
            print(f"step {step}: trainer peak {metrics.get('memory/trainer_peak_gib', 0):.1f} GiB (reserved "
                  f"{metrics.get('memory/trainer_peak_reserved_gib', 0):.1f}), held while "
                  f"generating {metrics.get('memory/trainer_held_gib', 0):.1f} GiB", flush=True)
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
    row = append_row(results_file(opts), TITLE, COLUMNS, [
        f"qwen3 {opts.size}", opts.rollout_tokens, "; ".join(setup(opts, config, knobs)),
        "yes" if fits else "no", f"{len(history)} steps, {ended}", f"{(trainer + generator) / GIB:.1f}",
        f"{poll.peak_mib / 1024:.1f}" if poll is not None and poll.peak_mib else "n/a",
        f"{(memory.trainer.peak - memory.trainer.context) / GIB:.1f}",
        f"{measured_trainer:.1f}" if device == "cuda" else "n/a", cells["step"], cells["tokens"], cells["mfu"],
        cells["generation"], " ".join(f"{d:g}" for d in diffs) or "-"], device=device)
    print(row, flush=True)
    return 0 if ended == "ok" or not fits else 1


def setup(opts: argparse.Namespace, config: Config, knobs: list[str]) -> list[str]:
    """The knobs column: the memory knobs set, vLLM's share, the rollouts a step, the mode, --set,
    the weight sync's path."""
    names = [k.split("=")[0] for k in knobs if k.endswith("true")]
    names.append(f"gpu_memory_utilization {config.generator.gpu_memory_utilization:g}")
    names.append(f"{config.rollout.prompts_per_step * config.rollout.group_size} rollouts a step")
    if opts.true_on_policy:
        names.append("true on-policy")
    return [*names, *opts.set, f"weights by {config.generator.weight_sync}"]


def parse_cell(text: str) -> list[str]:
    """`SIZE:TOKENS[:STEPS][:onpolicy]` as this script's options."""
    parts = text.split(":")
    on_policy = parts[-1] == "onpolicy"
    parts = parts[:-1] if on_policy else parts
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"--cells: {text!r} is not SIZE:TOKENS[:STEPS][:onpolicy]")
    steps = ["--steps", parts[2]] if len(parts) == 3 else []
    return ["--size", parts[0], "--rollout-tokens", parts[1], *steps, *(["--true-on-policy"] if on_policy else [])]


def run_cells(opts: argparse.Namespace, passed: list[str]) -> int:
    """Each of --cells in a process of its own (this script with its options and `passed`), within
    what is left of --budget-s; one that ends without its row gets one saying how it ended. The exit
    code is 1 when a case failed."""
    cells = [(cell, parse_cell(cell)) for cell in opts.cells]
    out, deadline, failed, done = results_file(opts), time.monotonic() + opts.budget_s, False, []
    for cell, options in cells:
        left = deadline - time.monotonic()
        if left < 60:
            done.append((cell, "not started: out of --budget-s", 0.0))
            continue
        command = [sys.executable, __file__, *options, *passed]
        print(f"\n===== cell {cell} (at most {left:.0f} s): {shlex.join(command)}", flush=True)
        rows, start = rows_in(out), time.monotonic()
        code = subprocess.run(["timeout", "--kill-after", "20", str(int(left)), *command]).returncode
        seconds = time.monotonic() - start
        ended = "ok" if code == 0 else "killed at --budget-s" if code in (124, 137) else f"exit code {code}"
        if rows_in(out) == rows:  # the case wrote no row: say how it ended
            size, tokens = options[1], options[3]
            append_row(out, TITLE, COLUMNS, [f"qwen3 {size}", tokens, " ".join(options[4:] + opts.set) or "-", "-",
                                             f"{ended} after {seconds:.0f} s", *["-"] * 9],
                       device="cpu" if opts.dry_run else "cuda")
        failed |= code != 0
        done.append((cell, ended, seconds))
    print("\n| cell | ended | seconds |\n|---|---|---|")
    print("\n".join(f"| {cell} | {ended} | {seconds:.0f} |" for cell, ended, seconds in done), flush=True)
    return 1 if failed else 0


def shared_options(opts: argparse.Namespace) -> list[str]:
    """The options every one of --cells runs with (all but the case's own)."""
    passed = ["--group-size", str(opts.group_size), "--row-tokens", str(opts.row_tokens), "--gpu-gib",
              str(opts.gpu_gib), "--ckpt-root", str(opts.ckpt_root)]
    for flag, value in (("--prompts", opts.prompts), ("--gpu-memory-utilization", opts.gpu_memory_utilization),
                        ("--out", opts.out)):
        passed += [flag, str(value)] if value is not None else []
    passed += ["--offload"] * opts.offload + ["--dry-run"] * opts.dry_run
    return passed + (["--set", *opts.set] if opts.set else [])


def rows_in(path: Path) -> int:
    return path.read_text().count("\n| ") if path.is_file() else 0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default=None, help="a Qwen3 shape: 0.6b, 1.7b, 4b, 8b, 14b, 32b (--dry-run: tiny)")
    parser.add_argument("--rollout-tokens", type=int, default=None, help="tokens per rollout (--dry-run: 48)")
    parser.add_argument("--cells", nargs="+", default=None, help="cases SIZE:TOKENS[:STEPS][:onpolicy], one by one")
    parser.add_argument("--budget-s", type=float, default=720, help="--cells: seconds for all of them")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: a step of ~131k tokens)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=16384,
                        help="rows hold as many whole rollouts as fit (at least one)")
    parser.add_argument("--offload", action="store_true", help="trainer.offload_optimizer first")
    parser.add_argument("--true-on-policy", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share (default: chosen)")
    parser.add_argument("--gpu-gib", type=float, default=139.8, help="the GPU's memory where none is seen (--dry-run)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--ckpt-root", type=Path, default=Path(tempfile.gettempdir()) / "rlactors_scale_checkpoints")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the tiny shape, the native engine, 2 steps")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main() -> None:
    opts = parser().parse_args()
    if opts.cells:
        sys.exit(run_cells(opts, shared_options(opts)))
    if opts.dry_run:
        opts.size, opts.rollout_tokens = opts.size or "tiny", opts.rollout_tokens or 48
        opts.prompts, opts.group_size, opts.row_tokens = 2, 2, 256
    elif opts.size is None or opts.rollout_tokens is None:
        parser().error("--size and --rollout-tokens are needed (or --dry-run, or --cells)")
    sys.exit(run_case(opts))


if __name__ == "__main__":
    main()
