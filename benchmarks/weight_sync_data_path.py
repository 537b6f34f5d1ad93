"""Weight sync's data path alone, without actors: what `weight_sync.py`'s "send ms" is made of.

    python benchmarks/weight_sync_data_path.py --size 0.6b
    python benchmarks/weight_sync_data_path.py --size 0.6b --chunk-mib 128 256 512 --profile /tmp/ws_trace
    python benchmarks/weight_sync_data_path.py --device cpu --size small      # gloo, no ceiling

Two processes, each seeing one GPU as the trainer's and a lone replica's do: the sender holds fp32
parameters of the model's shapes (the trainer's master weights) and packs them into the bf16 send
buffer chunk by chunk with the trainer's planned gathers; `WeightSender.send` and
`BufferReceiver.receive` (rlactors.weight_sync.broadcast) then run as in a push, the chunks by
copy engine into the receiver's lent buffer (by NCCL under `expandable_segments:True`), checksums
and the verdict included. No Monarch message is on the path, and the receiver calls each receive
as soon as its last one returned, so this is the push's send less its messaging and less any wait
for a late receiver. The ceiling is a plain NCCL broadcast of the same bytes in the same run.
With --profile DIR, one more sync per chunk size runs under torch.profiler, and each side's
trace goes to DIR as Chrome trace JSON (open in https://ui.perfetto.dev), e.g. to see whether the
copies wait for the sender's host between chunks.
Adds a row per chunk size to benchmarks/results/weight_sync_data_path.md (results_table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from results_table import RESULTS, append_row

from rlactors.models.checkpoint import model_shapes
from rlactors.models.tiny import TOKENIZER_VOCAB_SIZE, size_args
from rlactors.procs.placement import free_port
from rlactors.trainer.gather import plan_packing
from rlactors.weight_sync.broadcast import BufferReceiver, WeightSender
from rlactors.weight_sync.packed import CHUNK_BYTES, PackedLayout

TITLE = "Weight sync's data path: packing, chunks, checksums and verdict between two processes"
# send: `WeightSender.send` as timed inside it (packing, the chunks, the trailer, every verdict);
# send on device: its span on the GPU, first packing to last collective (the rest is the host's);
# pack: the packing within it; receive+verify: `BufferReceiver.receive`. Medians over --iters.
COLUMNS = ("model", "chunk MiB", "chunks", "chunks by", "send ms (min-max)", "send on device ms", "pack ms",
           "receive+verify ms", "NCCL ceiling ms", "send / ceiling")


def _layout(shapes: dict[str, torch.Size], chunk_mib: int) -> PackedLayout:
    return PackedLayout.of(((name, torch.empty(shape, dtype=torch.bfloat16, device="meta"))
                            for name, shape in shapes.items()), chunk_bytes=chunk_mib << 20)


def _side(rank: int, options: dict[str, Any], ports: list[int], gather_port: int, out) -> None:
    """Rank 0 sends, rank 1 receives, one group per chunk size; each puts its timings on `out`."""
    cuda = options["device"] == "cuda"
    if cuda:  # before CUDA starts in this process: it sees its own GPU only
        os.environ["CUDA_VISIBLE_DEVICES"] = options["gpus"][rank]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shapes = options.get("shapes") or model_shapes(size_args(options["size"], TOKENIZER_VOCAB_SIZE))
    timings = {}
    if rank == 0:
        import torch.distributed as dist

        # The planned gathers ask for the world size: a world of this process alone.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gather_port}", rank=0, world_size=1)
        generator = torch.Generator(device).manual_seed(0)
        params = {name: torch.nn.Parameter(torch.randn(shape, generator=generator, device=device) * 0.02)
                  for name, shape in shapes.items()}
    for chunk_mib, port in zip(options["chunk_mib"], ports):
        layout = _layout(shapes, chunk_mib)
        trace = f"{options['size']}_{chunk_mib}MiB_chunks"
        if rank == 0:
            timings[chunk_mib] = _send(layout, params, device, port, options, f"send_{trace}")
        else:
            timings[chunk_mib] = _receive(layout, device, port, options, f"receive_{trace}")
    out.put((rank, timings))


def _send(layout: PackedLayout, params: dict[str, torch.nn.Parameter], device: torch.device, port: int,
          options: dict[str, Any], trace: str) -> dict[str, Any]:
    gathers = {}

    def pack(chunk, _buffer) -> None:
        gathers[chunk.start].run()

    sender = WeightSender(layout, device, pack)
    sender.join("127.0.0.1", port, 2)
    gathers.update(plan_packing(params, layout, torch.bfloat16, sender.buffer, device))
    sent = [asyncio.run(sender.send(version)) for version in range(1, options["iters"] + 2)][1:]
    if any(s["verified"] != 1 for s in sent):
        raise RuntimeError(f"the receiver did not verify every sync: {[s['verified'] for s in sent]}")
    _profiled(options, trace, lambda: asyncio.run(sender.send(options["iters"] + 2)))
    return {"send_s": [s["send_s"] for s in sent], "send_device_s": [s["send_device_s"] for s in sent],
            "pack_s": [s["pack_s"] for s in sent], "copy_engine": all(s["copy_engine"] == 1.0 for s in sent)}


def _receive(layout: PackedLayout, device: torch.device, port: int, options: dict[str, Any],
             trace: str) -> dict[str, Any]:
    receiver = BufferReceiver(layout, device)
    receiver.join("127.0.0.1", port, 1, 2)
    received = [receiver.receive(version) for version in range(1, options["iters"] + 2)][1:]
    _profiled(options, trace, lambda: receiver.receive(options["iters"] + 2))
    return {"receive_verify_s": [r["receive_verify_s"] for r in received]}


def _profiled(options: dict[str, Any], name: str, sync) -> None:
    """One more sync, under torch.profiler where --profile names a directory (the trace: DIR/name.json)."""
    if not options["profile"]:
        sync()
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if options["device"] == "cuda" else [])
    with profile(activities=activities) as trace:
        sync()
    trace.export_chrome_trace(str(Path(options["profile"]) / f"{name}.json"))


def measure(options: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each chunk size's timings: the sender's and the receiver's, over --iters syncs after one warm-up."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in options["chunk_mib"]]
    mp.start_processes(_side, args=(options, ports, free_port(), out), nprocs=2, start_method="spawn")
    sides = dict(out.get() for _ in range(2))
    return {mib: {**sides[0][mib], **sides[1][mib]} for mib in options["chunk_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", default="0.6b", help="rlactors.models.tiny size: the parameters' shapes")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[CHUNK_BYTES >> 20],
                        help="chunk sizes to run, each in a group of its own (default: the sync's own)")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--profile", metavar="DIR", help="write a torch.profiler trace of one more sync per side")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters: at least 1, got {args.iters}")
    if any(mib < 1 for mib in args.chunk_mib):
        parser.error(f"--chunk-mib: each at least 1, got {args.chunk_mib}")
    options = {**vars(args), "gpus": _two_gpus() if args.device == "cuda" else []}
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    results = measure(options)
    shapes = model_shapes(size_args(args.size, TOKENIZER_VOCAB_SIZE))
    layouts = {mib: _layout(shapes, mib) for mib in args.chunk_mib}
    num_bytes = next(iter(layouts.values())).total_bytes  # the same at any chunk size
    ceiling = None
    if args.device == "cuda":
        from weight_sync import nccl_ceiling

        ceiling = nccl_ceiling(num_bytes, [0, 1], args.iters)
    for mib, timings in results.items():
        sends = timings["send_s"]
        send = statistics.median(sends)
        row = [f"{args.size} ({num_bytes / 1e6:.0f} MB)", str(mib), str(len(layouts[mib].chunks)),
               "copy engine" if timings["copy_engine"] else "broadcast",
               f"{send * 1e3:.2f} ({min(sends) * 1e3:.2f}-{max(sends) * 1e3:.2f})",
               f"{statistics.median(timings['send_device_s']) * 1e3:.2f}",
               f"{statistics.median(timings['pack_s']) * 1e3:.2f}",
               f"{statistics.median(timings['receive_verify_s']) * 1e3:.2f}",
               "n/a" if ceiling is None else f"{ceiling * 1e3:.2f}",
               "n/a" if ceiling is None else f"{send / ceiling:.2f}x"]
        append_row(RESULTS / "weight_sync_data_path.md", TITLE, COLUMNS, row, device=args.device)
        print(" | ".join(row), flush=True)


def _two_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < 2:
        raise SystemExit("error: needs 2 GPUs (the sender's and the receiver's)")
    return gpus[:2]


if __name__ == "__main__":
    main()
