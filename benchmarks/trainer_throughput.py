"""Trainer throughput: tokens/s and MFU of forward_backward + optim_step on packed batches.

    .venv/bin/python benchmarks/trainer_throughput.py                      # CPU: tiny and small
    python benchmarks/trainer_throughput.py --device cuda --sizes 0.6b 1.7b   # one GPU
    torchrun --nproc-per-node 2 benchmarks/trainer_throughput.py --device cuda --sizes 1.7b  # FSDP2
    python benchmarks/trainer_throughput.py --device cuda --family llama --sizes 1b  # another family
    python benchmarks/trainer_throughput.py --device cuda --family qwen3_moe --sizes 30b-a3b-4l  # 4 MoE layers
    torchrun --nproc-per-node 2 benchmarks/trainer_throughput.py --device cuda --family qwen3_moe \
        --sizes 30b-a3b-4l --expert-parallel 2   # the experts split by expert over the 2 GPUs

Each size adds a row to results/trainer_throughput_{cpu,gpu}.md (results_table.py). `--lora-rank R`
trains rank-R adapters over the frozen base instead (model.lora, docs/lora.md).

It drives PolicyTrainerCore directly (the code inside each PolicyTrainer actor), on a random-init
checkpoint of each size (rlactors.models.tiny). Rows of `--row-tokens` are filled end to end with
documents of random lengths; their generator logprobs are the trainer's own, so the GRPO ratio is
1 as on policy. A step is `--microbatches` forward_backward calls of `--rows` rows each, then
optim_step; the first `--warmup` steps are not timed.

MFU = model FLOPs / (step time x peak bf16 FLOP/s x GPUs). Model FLOPs per step = 3 x forward:
2 x (matmul weights incl. the LM head; of a mixture of experts, the router and the k experts a
token is routed to: active parameters) per token, plus causal attention 2 x 2 x heads x head_dim x
s(s+1)/2 per document of s tokens and layer. Recomputation (activation checkpointing, the chunked
log-softmax) is not counted, as MFU conventionally does not.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from results_table import RESULTS, append_row

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlactors.config import LoraConfig, LossConfig, ModelConfig, TrainerConfig  # noqa: E402
from rlactors.models.args import FAMILIES, ModelArgs  # noqa: E402
from rlactors.models.checkpoint import load_args  # noqa: E402
from rlactors.models.tiny import kept_checkpoint  # noqa: E402
from rlactors.on_policy.sides import sides  # noqa: E402
from rlactors.trainer.batch import MicroBatch  # noqa: E402
from rlactors.trainer.core import PolicyTrainerCore  # noqa: E402
from rlactors.trainer.losses import LossNorm  # noqa: E402
from rlactors.trainer.parallel import init_distributed  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense, SXM


def packed_microbatch(rows: int, row_tokens: int, doc_tokens: tuple[int, int], vocab: int,
                      generator: torch.Generator) -> tuple[MicroBatch, list[int]]:
    """Rows filled end to end with documents of random lengths (the last one cut to fit)."""
    positions, lengths = [], []
    for _ in range(rows):
        row = []
        while sum(row) < row_tokens:
            n = int(torch.randint(doc_tokens[0], doc_tokens[1] + 1, (1,), generator=generator))
            row.append(min(n, row_tokens - sum(row)))
        lengths += row
        positions.append(torch.cat([torch.arange(n) for n in row]))
    shape = (rows, row_tokens)
    loss_mask = torch.rand(shape, generator=generator) < 0.7
    mb = MicroBatch(
        input_ids=torch.randint(vocab, shape, generator=generator), positions=torch.stack(positions),
        target_ids=torch.randint(vocab, shape, generator=generator), loss_mask=loss_mask,
        advantages=torch.randn(shape, generator=generator), generator_logprobs=torch.zeros(shape),
        versions=torch.zeros(shape, dtype=torch.long))
    return mb, lengths


def train_flops(args: ModelArgs, doc_lengths: list[int]) -> float:
    h, d, L = args.hidden_size, args.head_dim, args.num_hidden_layers
    q, kv = args.num_attention_heads * d, args.num_key_value_heads * d
    matmul_weights = L * (h * q + 2 * h * kv + q * h) + sum(_active_mlp_weights(args, i) for i in range(L))
    matmul_weights += args.vocab_size * h
    tokens = sum(doc_lengths)
    attention = L * 4 * q * sum(s * (s + 1) / 2 for s in doc_lengths)
    return 3 * (2 * matmul_weights * tokens + attention)


def _active_mlp_weights(args: ModelArgs, layer: int) -> int:
    """The MLP weights one token multiplies by in ``layer``: a sparse layer's router and k experts."""
    if not args.is_sparse_layer(layer):
        return 3 * args.hidden_size * args.intermediate_size
    moe = args.moe
    return args.hidden_size * (moe.num_experts + 3 * moe.num_experts_per_tok * moe.moe_intermediate_size)


def peak_tflops(override: float | None) -> float | None:
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def join_process_group(device: str) -> torch.device:
    """torchrun's env if present, else a one-rank group on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed(device)


def measure(size: str, ckpt_dir: Path, opts: argparse.Namespace, device: torch.device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    trainer = TrainerConfig(ranks=world, lr=1e-6, mixed_precision=device.type == "cuda",
                            activation_checkpointing=opts.activation_checkpointing,
                            logprob_chunk_tokens=opts.logprob_chunk_tokens, compile_layers=opts.compile,
                            expert_parallel=opts.expert_parallel)
    model = ModelConfig(path=str(ckpt_dir), lora=LoraConfig(rank=opts.lora_rank))
    core = PolicyTrainerCore(model, trainer, device, sides(False, "native", device).trainer)
    args = core.args
    loss = LossConfig(name="grpo")
    generator = torch.Generator().manual_seed(1000)  # the same on every rank: all see the same step
    steps = []  # each: (per-rank microbatch lists, norm, model FLOPs of this rank's documents)
    for _ in range(opts.warmup + opts.steps):
        per_rank = [[packed_microbatch(opts.rows, opts.row_tokens, tuple(opts.doc_tokens), args.vocab_size, generator)
                     for _ in range(opts.microbatches)] for _ in range(world)]
        flops = train_flops(args, [n for _, lengths in per_rank[rank] for n in lengths])
        per_rank = [[mb for mb, _ in mbs] for mbs in per_rank]
        for i in range(opts.microbatches):
            # On policy: the generator's logprobs are the trainer's own (ratio 1, finite gradients).
            per_rank[rank][i].generator_logprobs = core.compute_logprobs([mbs[i] for mbs in per_rank])
        norm = LossNorm.for_step([mb for mbs in per_rank for mb in mbs], loss.name)
        steps.append((per_rank, norm, flops))

    times = []
    for i, (per_rank, norm, _) in enumerate(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for j in range(opts.microbatches):
            core.forward_backward([per_rank[r][j] for r in range(world)], norm, loss)
        metrics = core.optim_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= opts.warmup:
            times.append(time.perf_counter() - start)
        if metrics["update_skipped"]:
            raise RuntimeError(f"step {i} skipped its update (grad norm {metrics['grad_norm']})")
    if opts.profile:
        per_rank, norm, _ = steps[-1]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for j in range(opts.microbatches):
                core.forward_backward([per_rank[r][j] for r in range(world)], norm, loss)
            core.optim_step()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        opts.profile.mkdir(parents=True, exist_ok=True)
        (opts.profile / f"{size}_rank{rank}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    step_time = sum(times) / len(times)
    tokens_per_step = world * opts.microbatches * opts.rows * opts.row_tokens
    flops = sum(f for _, _, f in steps[opts.warmup:]) / opts.steps  # this rank's share
    peak = peak_tflops(opts.peak_tflops)
    result = {
        "size": size, "params": args.num_params(), "active_params": args.num_active_params(), "ranks": world,
        "tokens_per_step": tokens_per_step, "step_s": step_time, "tokens_per_s": tokens_per_step / step_time,
        "tflops_per_rank": flops / step_time / 1e12,
        "mfu": flops / step_time / (peak * 1e12) if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    del core
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


COLUMNS = ("model", "params", "ranks", "setup", "tokens/step", "step (s)", "tokens/s", "TFLOP/s per rank", "MFU",
           "peak memory (GiB)")


def params_cell(result: dict) -> str:
    """The parameter count, and of a mixture of experts the active ones (those MFU counts)."""
    total, active = result["params"], result["active_params"]
    return f"{total / 1e6:.1f}M" + (f" ({active / 1e6:.1f}M active)" if active != total else "")


def append_rows(results: list[dict], opts: argparse.Namespace, path: Path) -> None:
    setup = (f"{'bf16 mixed precision' if opts.device == 'cuda' else 'fp32'}; layers "
             f"{'compiled' if opts.compile and opts.device == 'cuda' else 'eager'}; activation checkpointing "
             f"{'on' if opts.activation_checkpointing else 'off'}; {opts.microbatches} x {opts.rows} x "
             f"{opts.row_tokens} tokens per rank; documents of {opts.doc_tokens[0]}-{opts.doc_tokens[1]}; "
             f"{opts.steps} timed steps after {opts.warmup}")
    if opts.expert_parallel > 1:
        setup += f"; experts split over groups of {opts.expert_parallel} ranks (trainer.expert_parallel)"
    if opts.lora_rank:  # the base's weight gradients are not computed: MFU overstates the work done
        setup += f"; LoRA rank {opts.lora_rank} on every linear over the frozen base (MFU by a full fine-tune's FLOPs)"
    if opts.device == "cpu":  # CPU numbers depend on what else runs: the load average says how busy it was
        setup += (f"; {torch.get_num_threads()} torch threads, load average "
                  f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    else:
        setup += f"; peak {peak_tflops(opts.peak_tflops) or 'unknown'} TFLOP/s bf16 per GPU"
    world = results[0]["ranks"]
    launcher = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    for r in results:
        mfu = f"**{100 * r['mfu']:.1f}%**" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
        append_row(path, "Trainer throughput: forward_backward + optim_step", COLUMNS,
                   [f"{opts.family} {r['size']}", params_cell(r), world, setup, r["tokens_per_step"],
                    f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_rank']:.3g}", mfu, mem],
                   device=opts.device, launcher=launcher)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3",
                        help="model family of the random checkpoints (rlactors.models.tiny)")
    parser.add_argument("--sizes", nargs="+", default=None,
                        help="tiny small, or a real shape of the family: 0.6b 1.7b (qwen3), 30b-a3b-4l (qwen3_moe), "
                        "0.5b (qwen2), 1b (llama)")
    parser.add_argument("--row-tokens", type=int, default=None)
    parser.add_argument("--rows", type=int, default=1, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, default=None, help="forward_backward calls per step")
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the decoder layers (trainer.compile_layers; CUDA only)")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=1024)
    parser.add_argument("--expert-parallel", type=int, default=1,
                        help="trainer.expert_parallel: a mixture of experts' ranks per expert-parallel group")
    parser.add_argument("--lora-rank", type=int, default=0, help="model.lora.rank: train adapters on every linear")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak per device (default: by GPU name)")
    parser.add_argument("--ckpt-root", type=Path, default=None, help="where random checkpoints are written")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="dir for a torch.profiler table of one more step")
    opts = parser.parse_args()
    cuda = opts.device == "cuda"
    opts.sizes = opts.sizes or (["0.6b", "1.7b"] if cuda else ["tiny", "small"])
    opts.row_tokens = opts.row_tokens or (16384 if cuda else 512)
    opts.microbatches = opts.microbatches or (8 if cuda else 2)
    opts.doc_tokens = opts.doc_tokens or ([512, 4096] if cuda else [32, 256])
    opts.out = opts.out or RESULTS / f"trainer_throughput_{'gpu' if cuda else 'cpu'}.md"

    device = join_process_group(opts.device)
    rank = dist.get_rank()
    root = opts.ckpt_root or Path(tempfile.gettempdir()) / "rlactors_bench_ckpts"
    results = []
    for size in opts.sizes:
        if rank == 0:
            kept_checkpoint(root, size, opts.family)
        dist.barrier()
        ckpt = kept_checkpoint(root, size, opts.family)  # made by rank 0: found here
        load_args(ckpt)
        results.append(measure(size, ckpt, opts, device))
        if rank == 0:
            r = results[-1]
            mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
            print(f"{size}: {r['tokens_per_s']:.0f} tokens/s, {r['step_s']:.3f} s/step{mfu}", flush=True)
    if rank == 0:
        append_rows(results, opts, opts.out)
        print(f"added {len(results)} row(s) to {opts.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
