"""LoRA weight sync: the adapters alone against the full weights, each beside a plain device copy
of the same bytes measured in the same run.

    python benchmarks/lora_weight_sync.py --sizes 1.7b 8b --ranks 16 64          # one GPU
    python benchmarks/lora_weight_sync.py --device cpu --sizes tiny --ranks 8 --iters 2   # smoke test

For each size, the full weights (rank 0 in the table) and then the adapters of each rank (every
decoder layer's q/k/v/o/gate/up/down linears, model.lora's default targets) go by weight sync's
two paths. The broadcast's data path (`weight_sync_data_path.measure`: the trainer's packing into
the bf16 send buffer, `WeightSender.send`, the replica's `BufferReceiver.receive`, checksums and
the verdict), trainer and replica on a GPU each (`--gpus 2`; on CPU over gloo): a run whose
trainer and replica are separate; not on one GPU, where NCCL cannot put both ranks. Messages
(`messages_s`): a one-GPU run's, trainer and replica colocated. The device copy is one `copy_` of
a buffer of the same bytes on that GPU, timed the same way. merge: with
LoRA, a vLLM replica's load after the receive (`rlactors.lora.replica.load_adapters`: W + (alpha/r)
B A from the kept base into every adapted linear, the batch-invariant matmul), on the GPU.
Medians over --iters (--message-iters) after one warm-up. Adds rows to
benchmarks/results/lora_weight_sync.md (results_table.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from results_table import RESULTS, append_row
from weight_sync_data_path import measure

from rlactors.config import LoraConfig
from rlactors.lora.adapters import adapter_parameters, initial_adapters_of, scale, to_lora
from rlactors.lora.replica import load_adapters
from rlactors.models.checkpoint import model_shapes
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.tiny import TOKENIZER_VOCAB_SIZE, size_args
from rlactors.weight_sync.checksum import state_checksum
from rlactors.weight_sync.packed import CHUNK_BYTES, PackedLayout

TITLE = "LoRA weight sync: adapters only vs full weights, beside a plain device copy of the same bytes"
COLUMNS = ("model", "LoRA rank", "MB synced", "GPUs", "send ms (min-max)", "receive+verify ms",
           "device copy ms", "send / device copy", "merge ms", "messages ms", "messages / device copy")


def synced_shapes(size: str, rank: int) -> dict[str, torch.Size]:
    """What weight sync sends at `size`: every parameter (rank 0), or the rank-`rank` adapters of
    model.lora's default targets, by the trainer's own conversion of a meta model."""
    args = size_args(size, TOKENIZER_VOCAB_SIZE)
    if rank == 0:
        return model_shapes(args)
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    to_lora(model, LoraConfig(rank=rank), torch.bfloat16)
    return {name: p.shape for name, p in adapter_parameters(model).items()}


def device_copy_s(num_bytes: int, device: torch.device, iters: int) -> float:
    """Median seconds of one `copy_` of `num_bytes` between two buffers on `device`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def messages_s(shapes: dict[str, torch.Size], device: torch.device, iters: int) -> float:
    """Median seconds of weight sync by messages (a one-GPU run's: trainer and replica colocated)
    in one process, but for Monarch's transfer between the two: the trainer's copy of the synced
    bf16 tensors to the host and their checksum (`state_dict_for_sync`), the replica's check of
    that checksum and its copy back to the GPU (`load_weights`, before any merge)."""
    weights = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes.items()}
    times = []
    for _ in range(iters + 1):
        _synchronize(device)
        start = time.perf_counter()
        host = {name: t.cpu() for name, t in weights.items()}
        if state_checksum(host) != state_checksum(host):
            raise AssertionError("the checksum of the same tensors differs")
        for t in host.values():
            t.to(device)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def merge_s(size: str, rank: int, device: torch.device, iters: int) -> float:
    """Median seconds of a vLLM replica's load of the adapters at `size` (`load_adapters`: every
    adapted linear's merge from its base; uninitialised weights: the time does not depend on the
    values), the adapters already on the device, as a broadcast leaves them."""
    args = size_args(size, TOKENIZER_VOCAB_SIZE)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    model.to_empty(device=device).to(dtype)
    config = LoraConfig(rank=rank)
    adapters = [(name, t.to(device, dtype)) for name, t in initial_adapters_of(args, config).items()]
    times = []
    for _ in range(iters + 1):
        _synchronize(device)
        start = time.perf_counter()
        load_adapters(model, adapters, scale(config))
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", nargs="+", default=["1.7b", "8b"], help="rlactors.models.tiny sizes (qwen3)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                        help="1: sender and receiver share one GPU (a one-GPU run: messages only); 2: one each")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--message-iters", type=int, default=2,
                        help="timed syncs by messages (each full 8B one moves 16 GB through the host twice)")
    args = parser.parse_args()
    if min(args.iters, args.message_iters, *args.ranks) < 1:
        parser.error("--iters, --message-iters and every --ranks must be at least 1")
    cuda = args.device == "cuda"
    gpus = []
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(ids) < args.gpus:
            raise SystemExit(f"error: --gpus {args.gpus} but {len(ids)} GPU(s) visible")
        gpus = ids[:2]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    chunk_mib = CHUNK_BYTES >> 20
    for size in args.sizes:
        for rank in [0, *args.ranks]:
            shapes = synced_shapes(size, rank)
            num_bytes = PackedLayout.of((n, torch.empty(s, dtype=torch.bfloat16, device="meta"))
                                        for n, s in shapes.items()).total_bytes
            copy = device_copy_s(num_bytes, device, args.iters)
            broadcast = ["n/a"] * 3  # one GPU: NCCL cannot put two ranks on it
            if len(set(gpus)) == 2 or not cuda:
                timings = measure({"device": args.device, "size": size, "chunk_mib": [chunk_mib], "iters": args.iters,
                                   "profile": None, "gpus": gpus, "shapes": shapes})[chunk_mib]
                sends = timings["send_s"]
                send = statistics.median(sends)
                broadcast = [f"{send * 1e3:.2f} ({min(sends) * 1e3:.2f}-{max(sends) * 1e3:.2f})",
                             f"{statistics.median(timings['receive_verify_s']) * 1e3:.2f}", f"{send / copy:.1f}x"]
            messages = messages_s(shapes, device, args.message_iters)
            row = [size, str(rank) if rank else "full weights", f"{num_bytes / 1e6:.2f}", str(args.gpus if cuda else 0),
                   *broadcast[:2], f"{copy * 1e3:.3f}", broadcast[2],
                   f"{merge_s(size, rank, device, args.iters) * 1e3:.2f}" if rank else "n/a",
                   f"{messages * 1e3:.1f}", f"{messages / copy:.0f}x"]
            append_row(RESULTS / "lora_weight_sync.md", TITLE, COLUMNS, row, device=args.device)
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
