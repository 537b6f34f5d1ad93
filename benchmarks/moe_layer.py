"""One Qwen3-MoE sparse layer on CUDA: true on-policy against the default layer.

The true on-policy layer is what a vLLM replica runs in that mode (rlactors.on_policy.modules:
the batch-invariant router, stable top-k, all experts in one grouped launch per projection that
reads the token counts on the GPU, the weighted sum in order); the default layer is the trainer's
plain `SparseMoeBlock` (torch's grouped GEMM). Random bf16 weights of a real shape (`--size`,
rlactors.models.tiny). Decode sizes are timed replayed from a CUDA graph, as vLLM runs decode
steps; prefill sizes eagerly. Each size also checks the promise: the true on-policy layer's output
has the bits of the trainer's forward of the same layer (a batch-invariant matmul per expert).

    python benchmarks/moe_layer.py [--size 30b-a3b]

Prints a table per size and adds a row to results/moe_layer_gpu.md.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
from batch_invariant_matmul import graph_time
from results_table import RESULTS, append_row

from rlactors.models.moe import SparseMoeBlock
from rlactors.models.tiny import MOE_SIZES, size_args
from rlactors.on_policy.modules import to_batch_invariant

COLUMNS = ("shape", "bits equal to the trainer's", "decode tokens: true on-policy / default ms",
           "decode: true on-policy / default (geomean)", "prefill tokens: true on-policy / default ms",
           "prefill: true on-policy / default (geomean)")
DECODE, PREFILL = (1, 16, 64, 256), (2048, 8192)


def layers(size: str) -> tuple[SparseMoeBlock, SparseMoeBlock, SparseMoeBlock]:
    """The default layer, the engine's true on-policy one and the trainer's, with the same weights."""
    args = size_args(size, vocab_size=1024, family="qwen3_moe")
    default = SparseMoeBlock(args)
    for p in default.parameters():
        torch.nn.init.normal_(p, std=0.02)
    default = default.cuda().bfloat16()
    engine, trainer = copy.deepcopy(default), copy.deepcopy(default)
    to_batch_invariant(torch.nn.Sequential(engine), weights_frozen=True)
    to_batch_invariant(torch.nn.Sequential(trainer))
    return default, engine, trainer


def eager_time(fn, calls: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="30b-a3b", choices=sorted(MOE_SIZES))
    args = parser.parse_args()
    default, engine, trainer = layers(args.size)
    hidden = default.gate.in_features
    g = torch.Generator(device="cuda").manual_seed(0)
    same_bits, cells = True, {}
    with torch.inference_mode():
        for tokens in (*DECODE, *PREFILL):
            x, residual = (torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16() for _ in range(2))
            timer = graph_time if tokens in DECODE else eager_time
            ours = timer(lambda x=x, residual=residual: engine(x, residual))
            theirs = timer(lambda x=x, residual=residual: residual + default(x))
            cells[tokens] = (ours, theirs)
            with torch.inference_mode(False):
                trained = trainer(x.clone().requires_grad_(), residual.clone())  # autograd: a matmul per expert
            same_bits &= torch.equal(engine(x, residual), trained.detach())
            print(f"{tokens:>5} tokens: true on-policy {ours * 1e3:.3f} ms, default {theirs * 1e3:.3f} ms "
                  f"({ours / theirs:.2f}x)", flush=True)

    def listed(sizes):
        return ", ".join(f"{t}: {cells[t][0] * 1e3:.2f} / {cells[t][1] * 1e3:.2f}" for t in sizes)

    def geomean(sizes):
        return f"{math.exp(sum(math.log(cells[t][0] / cells[t][1]) for t in sizes) / len(sizes)):.2f}x"

    moe = MOE_SIZES[args.size]
    shape = (f"{args.size} layer: {moe.num_experts} experts, top {moe.num_experts_per_tok}, hidden {hidden}, "
             f"expert width {moe.moe_intermediate_size}, bf16")
    print(append_row(RESULTS / "moe_layer_gpu.md", "One Qwen3-MoE layer: true on-policy against the default",
                     COLUMNS, [shape, "yes" if same_bits else "**no**", listed(DECODE), geomean(DECODE),
                               listed(PREFILL), geomean(PREFILL)], device="cuda"))


if __name__ == "__main__":
    main()
