"""Weight sync: trainer (FSDP2 on 1-2 GPUs) -> every vLLM replica, against the NCCL ceiling.

    python benchmarks/weight_sync.py --size 1.7b --trainer-gpus 2 --replicas 2
    python benchmarks/weight_sync.py --device cpu --trainer-gpus 2 --replicas 2 --weight-sync broadcast
                                                           # native replicas on CPU: gloo broadcast
                                                           # (or `messages`: full tensors over Monarch)
    python benchmarks/weight_sync.py --size 4b --colocate --weight-sync shared
                                                           # one replica on the trainer's GPU, through
                                                           # the trainer's buffer mapped by CUDA IPC

Each sync is the controller's own path after one optimizer step of the trainer (on one short
sequence per rank, `Controller._train_on`): the full weights gathered from the FSDP shards into one
packed buffer (bf16) chunk by chunk, each chunk NCCL-broadcast from trainer rank 0 to every replica
worker once packed, then the checksum; each replica verifies it and loads the weights. By broadcast
to vLLM replicas of one GPU each, the push goes with the optimizer step and the trainer sends as
the step ends. The ceiling is a plain NCCL broadcast of the same number of bytes from GPU 0 to the
replicas' GPUs, measured in the same run; colocated (`--colocate`, trainer and replica on GPU 0),
a plain device-to-device copy of those bytes on GPU 0. Adds a row to benchmarks/results/weight_sync.md
(results_table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from monarch.actor import Actor, endpoint, this_host
from results_table import RESULTS, append_row

from rlactors.config import load_config
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.procs.supervision import use_fast_supervision
from rlactors.rollout.types import Episode, RolloutStatus
from rlactors.run.controller import Controller

TITLE = "Weight sync: trainer -> every generator replica, verified by checksum"
# total: what the training step waits for after its optimizer step has answered, as the controller
# times it, until every replica holds the weights verified. By broadcast: send, the trainer's side
# (packing the bf16 weights from the FSDP shards chunk by chunk, each chunk broadcast once packed,
# then the checksum; it ends once every replica's verdict on the checksum has reached it over the
# group; send on device: its span on the GPU, from the first packing to the last collective, the
# rest of send being the trainer's host's; pack: the packing within it; step wait: how long the
# send, made with the optimizer step, waited for it to end) and, on the slowest replica, receive +
# checksum; the rest is Monarch messaging: the router's plan before them, how late the send call and
# the last replica's receive started after the push asked for them (lag: with the push made with the
# optimizer step, while it runs), and how long the trainer's answer took once its send ended
# (reply). train step: the step's forward, backward and optimizer step on one short sequence per
# rank, as the controller times it. By messages: gather (full tensors on rank 0, checksummed) and
# transfer. served: until every replica has loaded them (apply: the load, by the copy plan or vLLM's
# load_weights, and the prefix-cache reset), between engine steps. chunks by: the copy engine into a
# lone replica's buffer, or NCCL (gloo) broadcast (rlactors.weight_sync.broadcast). Monarch round
# trip: a call that does nothing, from the controller to a proc of its own on this host and back, in
# the same run beside the system (median of ROUND_TRIPS), back to back and each after IDLE_S of
# idling: a push meets its procs idle (they train or wait between pushes), and Monarch answers a
# call after a pause more slowly (weight_sync.md, notes of 2026-11-27).
# Medians over --iters.
COLUMNS = ("model", "trainer GPUs", "replicas", "push with the optimizer step", "total ms (min-max)", "served ms",
           "send ms", "send on device ms", "pack ms", "gather ms", "transfer ms", "replica receive+verify ms",
           "plan ms", "send lag ms", "receive lag ms", "step wait ms", "reply ms", "train step ms", "replica apply ms",
           "copy plan", "chunks by", "Monarch round trip ms", "Monarch round trip after idle ms",
           "GB/s (bytes / total)", "NCCL ceiling ms", "total / ceiling")
ROUND_TRIPS = 200
IDLE_S = 0.005


class Echo(Actor):
    @endpoint
    async def echo(self) -> None:
        return None


async def monarch_round_trip() -> tuple[float, float]:
    """The median seconds of a call that does nothing, to a proc of its own on this host and back:
    back to back, and each after IDLE_S of idling."""
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        echo = procs.spawn("echo", Echo)
        await echo.echo.call_one()  # the actor is up
        medians = []
        for idle_s in (0.0, IDLE_S):
            times = []
            for _ in range(ROUND_TRIPS):
                await asyncio.sleep(idle_s)
                start = time.perf_counter()
                await echo.echo.call_one()
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        return medians[0], medians[1]
    finally:
        await procs.stop()


def _broadcast_worker(rank: int, world_size: int, num_bytes: int, gpus: list[int], port: int, iters: int, out) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(gpus[rank])
    # device_id: ranks on GPUs [0, 2, 3] must not let NCCL guess GPU = rank (that hangs the barrier).
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", gpus[rank]))
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.broadcast(buffer, src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def nccl_ceiling(num_bytes: int, gpus: list[int], iters: int) -> float:
    import torch.multiprocessing as mp

    from rlactors.procs.placement import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_broadcast_worker, args=(len(gpus), num_bytes, gpus, free_port(), iters, out),
                       nprocs=len(gpus), start_method="spawn")
    return out.get()


def device_copy_ceiling(num_bytes: int, iters: int) -> float:
    """The median seconds of one device-to-device copy of `num_bytes` on GPU 0."""
    source, destination = (torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(2))
    times = []
    for _ in range(iters + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        destination.copy_(source)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def _updates(controller: Controller) -> list[int]:
    return [r["engine"]["updates"] for r in (await controller.router.stats.call_one())["replicas"]]


def _episodes(ranks: int, policy_version: int) -> list[Episode]:
    """One short sequence per trainer rank: 32 prompt tokens, 32 generated ones to train on."""
    return [Episode(token_ids=list(range(1, 65)), loss_mask=[False] * 32 + [True] * 32,
                    generator_logprobs=[0.0] * 32 + [-1.0] * 32, advantages=[0.0] * 32 + [1.0] * 32,
                    versions=[-1] * 32 + [policy_version] * 32, group_id=f"g{i}", rollout_index=0, branch=0,
                    reward=1.0, status=RolloutStatus.COMPLETED) for i in range(ranks)]


async def measure(config, iters: int) -> tuple[list[dict[str, float]], tuple[float, float]]:
    """`iters` timed optimizer steps, each with the push of its policy, after a warm-up (first
    allocations, compiles, NCCL channels, and vLLM's own load_weights, which proves the copy plan),
    each also timed until every replica serves it; then, with the system still up,
    `monarch_round_trip()`."""
    controller = Controller(config)
    try:
        await controller.start()
        runs = []
        for step in range(1, iters + 2):
            loaded = [n + 1 for n in await _updates(controller)]
            episodes = _episodes(config.trainer.ranks, controller.policy_version)
            train_start = time.perf_counter()
            _, pushing = await controller._train_on(episodes, step)
            stepped = time.perf_counter()
            timings = await (pushing or controller.push_weights(controller.policy_version))
            timings["total_s"] = time.perf_counter() - stepped
            while await _updates(controller) != loaded:
                await asyncio.sleep(0.001)
            timings["served_s"] = time.perf_counter() - stepped
            timings["train_step_s"] = stepped - train_start
            timings["with_step"] = pushing is not None
            timings.update(await controller.weight_sync.settled())
            last = [r["engine"]["last_update"] for r in (await controller.router.stats.call_one())["replicas"]]
            timings["replica_apply_s"] = max(u["apply_s"] for u in last)
            if all("copy_plan" in u for u in last):
                timings["copy_plan"] = min(u["copy_plan"] for u in last)
            runs.append(timings)
        return runs[1:], await monarch_round_trip()
    finally:
        await controller.shutdown()


def _chunks_by(runs: list[dict[str, float]]) -> str:
    if "checksum_s" in runs[0]:
        return "shared buffer"
    if "copy_engine" not in runs[0]:
        return "messages"
    return "copy engine" if all(r["copy_engine"] == 1.0 for r in runs) else "broadcast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", default="0.6b", help="rlactors.models.tiny size of the random checkpoint")
    parser.add_argument("--trainer-gpus", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--weight-sync", choices=("auto", "messages", "broadcast", "shared"), default="auto",
                        help="generator.weight_sync (auto: broadcast for vLLM, shared for one colocated vLLM "
                             "replica, messages for native replicas)")
    parser.add_argument("--colocate", action="store_true",
                        help="controller.colocate: the replica on the trainer's GPU (one of each)")
    parser.add_argument("--dtype",
                        help="model.dtype of the synced weights (default: bfloat16 on cuda, the config's on cpu)")
    args = parser.parse_args()

    use_fast_supervision()
    ckpt = Path(tempfile.mkdtemp(prefix="rlactors_ws_")) / args.size
    make_tiny_checkpoint(ckpt, size=args.size)
    cuda = args.device == "cuda"
    overrides = [f'model.path="{ckpt}"', f"trainer.ranks={args.trainer_gpus}", f"generator.replicas={args.replicas}",
                 f'controller.device="{args.device}"', f'controller.run_dir="{ckpt.parent / "run"}"',
                 "generator.max_model_len=512", "rollout.max_total_tokens=512",
                 f'generator.weight_sync="{args.weight_sync}"',
                 "controller.steps=1000000", "controller.checkpoint_every=0"]  # no step checkpoints
    if args.colocate:
        overrides.append("controller.colocate=true")
    if args.dtype:
        overrides.append(f'model.dtype="{args.dtype}"')
    if cuda:
        overrides += ['generator.engine="vllm"', f"generator.gpu_memory_utilization={0.25 if args.colocate else 0.35}",
                      'generator.update_mode="hot_swap"']
        if not args.dtype:
            overrides.append('model.dtype="bfloat16"')
    config = load_config(None, overrides)
    runs, (round_trip, idle_round_trip) = asyncio.run(measure(config, args.iters))

    def median_ms(key: str) -> str:
        return f"{statistics.median(r[key] for r in runs) * 1e3:.1f}" if key in runs[0] else "n/a"

    totals = [r["total_s"] for r in runs]
    total, num_bytes = statistics.median(totals), runs[0]["bytes"]
    ceiling, ratio = "n/a", "n/a"
    if cuda:
        replica_gpus = [args.trainer_gpus + i for i in range(args.replicas)]
        seconds = device_copy_ceiling(int(num_bytes), args.iters) if args.colocate else \
            nccl_ceiling(int(num_bytes), [0, *replica_gpus], args.iters)
        copy = ", device copy" if args.colocate else ""
        ceiling, ratio = f"{seconds * 1e3:.1f} ({num_bytes / seconds / 1e9:.0f} GB/s{copy})", f"{total / seconds:.2f}x"
    figures = [f"{args.size} ({num_bytes / 1e6:.0f} MB)", args.trainer_gpus, args.replicas,
               "yes" if all(r["with_step"] for r in runs) else "no",
               f"{total * 1e3:.1f} ({min(totals) * 1e3:.1f}-{max(totals) * 1e3:.1f})", median_ms("served_s"),
               median_ms("send_s"), median_ms("send_device_s"), median_ms("pack_s"), median_ms("gather_s"),
               median_ms("transfer_s"),
               median_ms("replica_receive_verify_s" if "copy_engine" in runs[0] else "replica_verify_s"),
               median_ms("plan_s"), median_ms("send_lag_s"),
               median_ms("receive_lag_s"), median_ms("step_wait_s"), median_ms("reply_lag_s"),
               median_ms("train_step_s"), median_ms("replica_apply_s"),
               "yes" if all(r.get("copy_plan") == 1.0 for r in runs) else "no", _chunks_by(runs),
               f"{round_trip * 1e3:.2f}", f"{idle_round_trip * 1e3:.2f}",
               f"{num_bytes / total / 1e9:.1f}",
               ceiling, ratio]
    print(append_row(RESULTS / "weight_sync.md", TITLE, COLUMNS, figures, device=args.device))


if __name__ == "__main__":
    main()
