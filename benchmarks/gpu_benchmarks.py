"""The GPU benchmarks, by what they measure. Each mode runs the benchmark tools of benchmarks/ one
after another on the first `--gpus` visible GPUs; every tool adds dated, commit-stamped rows to its
own table in benchmarks/results/ (index: benchmarks/results/README.md).

    python benchmarks/gpu_benchmarks.py generation               # 1 GPU: router vs raw vLLM
    python benchmarks/gpu_benchmarks.py training [--gpus 2]      # trainer MFU, 1.7B and 4B; 2 GPUs: FSDP2 too
    python benchmarks/gpu_benchmarks.py weight-sync [--gpus 4]   # 2 GPUs: 1 -> 1; 4 GPUs: 2 -> 2 too
    python benchmarks/gpu_benchmarks.py end-to-end [--gpus 2|4]  # sync vs async, configs/alphabet_sort_<N>gpu.toml
    python benchmarks/gpu_benchmarks.py on-policy-cost           # 1 GPU: true on-policy cost, matmul vs cuBLAS
    python benchmarks/gpu_benchmarks.py learning-curve [--gpus 2|4] [--true-on-policy]  # the GPU demo, 100 steps
    python benchmarks/gpu_benchmarks.py moe                      # 1 GPU: Qwen3-MoE generation, training, a run
    python benchmarks/gpu_benchmarks.py scale                    # 1 GPU, ~40 min: 1.7B/4B/8B x 2k/8k/16k, colocated
    python benchmarks/gpu_benchmarks.py scale-on-policy          # 1 GPU, ~12 min: 5 true on-policy steps of 4B, 8B
    python benchmarks/gpu_benchmarks.py lora [--gpus 2]          # LoRA: weight sync, adapters vs full; 8B steps
    python benchmarks/gpu_benchmarks.py agent                    # 1 GPU: the agent example learning; gateway cost
    python benchmarks/gpu_benchmarks.py shared-sync              # 1 GPU: colocated weight sync by CUDA IPC
    python benchmarks/gpu_benchmarks.py distill                  # 1 GPU: 1.7B teacher's scoring, step vs GRPO

Which GPUs a mode may use and what each runs: `MODES` below. Needs vLLM and Monarch importable
(docs/gpu.md); the GPU test suite is scripts/gpu_suite.py. The tools' output streams to the
terminal; a table of steps, exit codes and seconds comes last, and the exit code is non-zero when a
step failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from results_table import RESULTS

ROOT = Path(__file__).resolve().parents[1]
PY = "python"  # run as this interpreter (sys.executable)
GENERATOR = [PY, "benchmarks/generator_throughput.py", "--device", "cuda"]
TRAINER = [PY, "benchmarks/trainer_throughput.py", "--device", "cuda"]
SYNC = [PY, "benchmarks/weight_sync.py", "--iters", "5"]
SYNC_DATA_PATH = [PY, "benchmarks/weight_sync_data_path.py", "--iters", "9"]
SCALE_CHECKPOINTS = Path(tempfile.gettempdir()) / "rlactors_scale_checkpoints"  # colocated_scale.py's default
COST = [PY, "benchmarks/on_policy_cost.py", "--device", "cuda", "--engines", "vllm", "--repeats", "3",
        "--train-steps", "2"]


@dataclass
class Mode:
    gpus: tuple[int, ...]  # the machine sizes it runs on; the first is the default
    steps: Callable[[int, bool], list[tuple[str, list[str]]]]  # (gpus, true on-policy) -> (name, command)s


def generation(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    return [("0.6b", [*GENERATOR, "--size", "0.6b"]),
            ("1.7b", [*GENERATOR, "--size", "1.7b"]),
            ("0.6b, 2 replicas", [*GENERATOR, "--size", "0.6b", "--replicas", "2"]),
            ("1.7b, 2 replicas", [*GENERATOR, "--size", "1.7b", "--replicas", "2"])]


def training(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Trainer MFU of Qwen3-1.7B and 4B in one run (issue #59 asks for 4B >= 45% beside 1.7B), on
    the checkpoints the scale modes keep (4B at these rows outgrows an 80 GB GPU); on 2 GPUs, 1.7B
    with FSDP2 over both too. Needs neither vLLM nor Monarch."""
    steps = [("1.7b and 4b", [*TRAINER, "--sizes", "1.7b", "4b", "--ckpt-root", str(SCALE_CHECKPOINTS)])]
    if gpus == 2:
        steps.append(("1.7b, FSDP2 over 2 GPUs", [PY, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", "2", *TRAINER[1:], "--sizes", "1.7b"]))
    return steps


def weight_sync(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    steps = [(f"{size}, 1 -> 1", [*SYNC, "--size", size, "--trainer-gpus", "1", "--replicas", "1"])
             for size in ("1.7b", "0.6b")]
    steps += [(f"{size}, the data path alone", [*SYNC_DATA_PATH, "--size", size, "--chunk-mib", "128", "256", "512"])
              for size in ("1.7b", "0.6b")]
    if gpus == 4:
        steps.append(("1.7b, 2 -> 2", [*SYNC, "--size", "1.7b", "--trainer-gpus", "2", "--replicas", "2"]))
    return steps


def lora(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #60 on one GPU, 6.5 minutes at most (each step's limit in seconds below): weight
    sync of the adapters (rank 16, 64) against the full weights at the 1.7B and 8B shapes, by
    broadcast and by messages (a one-GPU run's), each beside a device copy of the same bytes, and
    the replica's merge; then LoRA training steps (rank 16, every linear) at the Qwen3-8B shape on
    one GPU with their peak memory. On two GPUs the broadcast goes from one to the other too."""
    command = [PY, "benchmarks/lora_weight_sync.py", "--sizes", "1.7b", "8b", "--ranks", "16", "64",
               "--iters", "3", "--message-iters", "1"]
    steps = [("1.7b and 8b, one GPU", within(170, [*command, "--gpus", "1"]))]
    if gpus == 2:
        steps.append(("1.7b and 8b, one GPU each", within(170, [*command, "--gpus", "2"])))
    # The 8B checkpoint is written first (~2 minutes) unless the scale modes left theirs
    steps.append(("8b LoRA training, one GPU", within(220, [
        *TRAINER, "--sizes", "8b", "--lora-rank", "16", "--row-tokens", "4096", "--microbatches", "2",
        "--steps", "2", "--warmup", "1", "--no-compile",
        "--ckpt-root", str(SCALE_CHECKPOINTS)])))
    return steps


def end_to_end(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    steps = {1: "13", 2: "7", 4: "6"}[gpus]  # 2 GPUs: the three runs took 274 s on H200 x2 (2026-11-26)
    return [(f"alphabet_sort_{gpus}gpu", [PY, "benchmarks/e2e_alphabet_sort.py", "--config",
                                          f"configs/alphabet_sort_{gpus}gpu.toml", "--steps", steps,
                                          "--staleness", "1", "2"])]


def on_policy_cost(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    return [("0.6b", [*COST, "--size", "0.6b"]), ("1.7b", [*COST, "--size", "1.7b"]),
            ("matmul vs cuBLAS", [PY, "benchmarks/batch_invariant_matmul.py"])]


def within(seconds: float, command: list[str]) -> list[str]:
    """``command`` stopped after ``seconds`` (exit code 124), with everything it started: coreutils
    timeout signals its whole process group (vLLM's and Monarch's processes too)."""
    return ["timeout", "--kill-after", "30", str(seconds), *command]


MOE_COST = [*COST[:COST.index("--repeats")], "--family", "qwen3_moe", "--repeats", "1"]


def moe(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #34 on one 80 GB GPU, about 15 minutes in all (at most 26: each step's limit in
    seconds below):
    one sparse layer of the Qwen3-30B-A3B shape, true on-policy vs default (moe_layer.py, ~15 s);
    generation default vs true on-policy at the Qwen3-30B-A3B shape (tied embeddings: 30.2B
    parameters, 56.3 GiB in bf16) on vLLM's dummy weights, 0.9 of the GPU leaving ~13 GiB of KV cache
    (~140k tokens) for 64 sequences; trainer MFU on active parameters, and the default vs true
    on-policy cost of generation and training, at 4 of its 48 layers (2.8B parameters, 0.54B active:
    ~45 GB of fp32 weights, gradients and AdamW state); 40 async true on-policy steps of the tiny MoE
    demo (configs/moe_1gpu.toml), and 10 in the default mode without and with routing replay."""
    runs = Path(tempfile.gettempdir()) / f"rlactors_moe_{time.strftime('%Y%m%d_%H%M%S')}"
    checkpoints = runs / "checkpoints"  # the 4-layer one made once (5.2 GiB), for both of its steps
    demo = [PY, "examples/alphabet_sort/run.py", "--config", "configs/moe_1gpu.toml"]
    # (name, seconds, overrides): true on-policy, and short default-mode runs, where vLLM returns
    # each token's experts and the trainer reports the share it routes otherwise, then replays them;
    # sync, so that every step trains on tokens of its current policy, the ones both mismatch
    # metrics cover
    short_sync = ["controller.steps=10", 'controller.mode="sync"', "controller.eval_every=0",
                  "controller.checkpoint_every=0"]
    demos = [("onpolicy", 270, ["model.true_on_policy=true", "controller.steps=40"]),
             ("default", 150, short_sync), ("replay", 150, [*short_sync, "model.routing_replay=true"])]
    steps = [
        ("one 30b-a3b layer, true on-policy vs default", within(120, [PY, "benchmarks/moe_layer.py"])),
        ("30b-a3b generation, dummy weights", within(360, [
            *MOE_COST, "--size", "30b-a3b", "--dummy-weights", "--train-steps", "0", "--num-prompts", "64",
            "--max-prompt", "256", "--max-tokens", "64", "--gpu-memory-utilization", "0.9"])),
        ("30b-a3b-4l trainer MFU", within(180, [
            *TRAINER, "--family", "qwen3_moe", "--sizes", "30b-a3b-4l", "--row-tokens", "8192", "--microbatches", "4",
            "--steps", "3", "--warmup", "2", "--ckpt-root", str(checkpoints)])),
        ("30b-a3b-4l generation and training cost", within(300, [
            *MOE_COST, "--size", "30b-a3b-4l", "--train-steps", "1", "--num-prompts", "64", "--max-prompt", "256",
            "--max-tokens", "64", "--ckpt-root", str(checkpoints)])),
    ]
    for mode, seconds, overrides in demos:
        run_dir, name = runs / f"moe_1gpu_{mode}", f"moe_1gpu_{mode}"
        command = [*demo, *overrides]
        steps += [(f"moe_1gpu demo, {mode}", within(seconds, [*command, f'controller.run_dir="{run_dir}"'])),
                  (f"{mode} curve", [PY, "benchmarks/learning_curve.py", str(run_dir), "--command", shlex.join(command),
                                     "--out", str(RESULTS / "moe_1gpu_learning.md")]),
                  (f"{mode} metrics", ["cp", str(run_dir / "metrics.jsonl"), str(RESULTS / f"{name}_metrics.jsonl")])]
    return steps


SCALE = [PY, "benchmarks/colocated_scale.py"]
# Issue #59's table: 1.7B, 4B and 8B by rollout length, a cell at a time. A cell makes its shape's
# checkpoint once, starts the trainer and vLLM (a few minutes of start-up, compiles included),
# then runs 2 steps of ~131k tokens; at 16k tokens a step decodes 16k tokens one after another.
# Expect about 40 minutes on an H200.
SCALE_CELLS = ["1.7b:2048", "4b:2048", "8b:2048", "1.7b:8192", "4b:8192", "8b:8192",
               "1.7b:16384", "4b:16384", "8b:16384"]
SCALE_BUDGET_S = 2700
# 5 true on-policy steps of 16 rollouts: 4B fully fine-tuned, 8B with its optimizer offloaded
# (the plan picks the knobs).
ON_POLICY_CELLS = ["4b:2048:5:onpolicy", "8b:2048:5:onpolicy"]
ON_POLICY_BUDGET_S = 900


def scale(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #59 on one GPU: Qwen3 shapes (1.7B, 4B, 8B) x rollouts of 2k, 8k and 16k tokens,
    trainer and vLLM colocated, taking turns (`generator.sleep`), one cell after another
    (colocated_scale.py --cells)."""
    return [("cells", within(SCALE_BUDGET_S + 60, [*SCALE, "--cells", *SCALE_CELLS,
                                                   "--budget-s", str(SCALE_BUDGET_S)]))]


def scale_on_policy(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """5 GRPO steps in true on-policy mode, colocated on one GPU: 8B with its optimizer state
    offloaded, 4B fully fine-tuned; `loss/logprob_diff/max` of every step in the row."""
    return [("true on-policy", within(ON_POLICY_BUDGET_S + 60, [
        *SCALE, "--prompts", "2", "--cells", *ON_POLICY_CELLS, "--budget-s", str(ON_POLICY_BUDGET_S)]))]


def distill(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #63 on one GPU, about 2-3 minutes (at most 5): a 1.7B-shape teacher's scoring
    throughput, and the step of a 0.6B-shape student with its scoring against GRPO alone."""
    return [("1.7b teacher, 0.6b student", within(300, [PY, "benchmarks/teacher_scoring.py", "--device", "cuda"]))]


def learning_curve(gpus: int, true_on_policy: bool) -> list[tuple[str, list[str]]]:
    """The demo as a user runs it, in a new run dir under the temp dir; its curve appended to the
    demo's results file, its metrics and drawn curve copied beside it."""
    name = f"alphabet_sort_{gpus}gpu{'_onpolicy' if true_on_policy else ''}_learning"
    run_dir = (Path(tempfile.gettempdir()) / f"rlactors_learning_{time.strftime('%Y%m%d_%H%M%S')}"
               / f"alphabet_sort_{gpus}gpu")  # the curve's heading names the dir
    demo = [PY, "examples/alphabet_sort/run.py", "--config", f"configs/alphabet_sort_{gpus}gpu.toml",
            *(["model.true_on_policy=true"] if true_on_policy else [])]
    return [("demo", [*demo, f'controller.run_dir="{run_dir}"']),
            ("curve", [PY, "benchmarks/learning_curve.py", str(run_dir), "--command", shlex.join(demo),
                       "--out", str(RESULTS / f"{name}.md")]),
            ("metrics", ["cp", str(run_dir / "metrics.jsonl"), str(RESULTS / f"{name}_metrics.jsonl")]),
            ("curve image", ["cp", str(run_dir / "reward_curve.png"), str(RESULTS / f"{name}_reward_curve.png")])]


# The agent example on one GPU (configs/agent_tools_1gpu.toml), each part's limit in seconds.
# The warm start stops at its first check (every 25 SFT steps) whose greedy accuracy on 100
# held-out train problems is >= 0.3: warmed to the end it answers every problem, leaving GRPO
# nothing to improve. Expected: the warm start ~2-4 min (tokenizing ~6400 demonstrations; SFT
# steps of ~15-30 ms, the accuracy reached around step 500-800; each check ~5-10 s of greedy
# episodes on the native engine, the first with Triton's compiles); the run ~5 min (vLLM's start,
# 50 sync steps of 256 rollouts of up to 3 turns through the gateway at ~4 s, 6 evaluations); the
# gateway ~4 min (8 rounds of its three modes after vLLM's start).
AGENT_WARM_START = (420, ["--size", "small", "--steps", "1500", "--batch-size", "64", "--variants", "16",
                          "--until-accuracy", "0.3", "--check-every", "25"])
AGENT_RUN_S = 360
GATEWAY_S = 360


def agent(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #62 on one GPU: the calculator agent's GPU warm start, its true on-policy run through
    the gateway (colocated vLLM) with the learning curve (held-out eval at step 0 and the end,
    `loss/logprob_diff/max` over every step) into agent_tools_1gpu_learning.md, then the gateway
    against direct router calls on a vLLM replica (gateway_overhead.md). About 12 minutes, at most
    19 (the limits above)."""
    run_dir = (Path(tempfile.gettempdir()) / f"rlactors_agent_{time.strftime('%Y%m%d_%H%M%S')}"
               / "agent_tools_1gpu")  # the curve's heading names the dir
    name = "agent_tools_1gpu_learning"
    seconds, warm_args = AGENT_WARM_START
    # the recipe as a user runs it; the warm start writes the checkpoint the config names
    warm_start = [PY, "examples/agent_tools/warm_start.py", "runs/agent_tools_warm_gpu", *warm_args, "--device", "cuda"]
    train = [PY, "-m", "rlactors.train", "--config", "configs/agent_tools_1gpu.toml"]
    recipe = f"{shlex.join(warm_start)} && {shlex.join(train)}"
    return [("warm start", within(seconds, warm_start)),
            ("true on-policy run", within(AGENT_RUN_S, [*train, f'controller.run_dir="{run_dir}"'])),
            ("curve", [PY, "benchmarks/learning_curve.py", str(run_dir), "--command", recipe,
                       "--out", str(RESULTS / f"{name}.md")]),
            ("metrics", ["cp", str(run_dir / "metrics.jsonl"), str(RESULTS / f"{name}_metrics.jsonl")]),
            ("curve image", ["cp", str(run_dir / "reward_curve.png"), str(RESULTS / f"{name}_reward_curve.png")]),
            ("gateway vs direct, vLLM", within(GATEWAY_S, [PY, "benchmarks/gateway_overhead.py", "--device", "cuda"]))]


def shared_sync(gpus: int, _: bool) -> list[tuple[str, list[str]]]:
    """Issue #59 on one GPU, ~5 minutes (at most 10: each step's limit below): the push through
    the shared buffer at the 1.7B and 4B shapes beside a plain device copy, then the GPU test of
    a colocated true on-policy vLLM replica in async mode (logprobs equal on every step; its
    variant with sleep turns runs in scripts/gpu_suite.py's "other" group)."""
    colocated = [*SYNC, "--colocate", "--weight-sync", "shared"]
    return [("1.7b, colocated", within(180, [*colocated, "--size", "1.7b"])),
            ("4b, colocated", within(240, [*colocated, "--size", "4b"])),
            ("test: colocated true on-policy, async", within(180, [
                PY, "-m", "pytest", "-x", "-q", "-m", "gpu", "tests/weight_sync/test_shared_sync_gpu.py", "-k",
                "async"]))]


MODES = {
    "generation": Mode((1,), generation),
    "training": Mode((1, 2), training),
    "weight-sync": Mode((2, 4), weight_sync),
    "end-to-end": Mode((1, 2, 4), end_to_end),
    "on-policy-cost": Mode((1,), on_policy_cost),
    "learning-curve": Mode((1, 2, 4), learning_curve),
    "moe": Mode((1,), moe),
    "scale": Mode((1,), scale),
    "scale-on-policy": Mode((1,), scale_on_policy),
    "lora": Mode((1, 2), lora),
    "agent": Mode((1,), agent),
    "shared-sync": Mode((1,), shared_sync),
    "distill": Mode((1,), distill),
}


def visible_gpus() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    return os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count)))).split(",")[:count]


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: the mode's smallest size)")
    parser.add_argument("--true-on-policy", action="store_true", help="learning-curve: the demo in true on-policy mode")
    args = parser.parse_args()
    mode = MODES[args.mode]
    gpus = args.gpus or mode.gpus[0]
    if gpus not in mode.gpus:
        fail(f"--gpus: {args.mode} runs on {' or '.join(map(str, mode.gpus))} GPU(s), not {gpus}")
    if args.true_on_policy and args.mode != "learning-curve":
        fail(f"--true-on-policy: only learning-curve takes it, not {args.mode}")
    devices = visible_gpus()
    if len(devices) < gpus:
        fail(f"--gpus: {args.mode} on {gpus} GPU(s) needs as many visible, found {len(devices)}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices[:gpus]), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = []
    for name, command in mode.steps(gpus, args.true_on_policy):
        print(f"\n===== {args.mode}: {name}: {shlex.join(command)}", flush=True)
        start = time.monotonic()
        code = subprocess.run([sys.executable if part == PY else part for part in command], cwd=ROOT,
                              env=env).returncode
        done.append((name, code, time.monotonic() - start))
        if code != 0 and args.mode == "learning-curve":
            break  # the later steps read the demo's run dir
    print(f"\n| {args.mode} on {gpus} GPU(s) | exit code | seconds |\n|---|---|---|")
    print("\n".join(f"| {name} | {code} | {seconds:.0f} |" for name, code, seconds in done))
    sys.exit(1 if any(code != 0 for _, code, _ in done) else 0)


if __name__ == "__main__":
    main()
