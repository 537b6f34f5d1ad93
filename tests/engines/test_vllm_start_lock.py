"""vLLM engines that share a GPU start one after another (`one_start_per_gpu`), on CPU: real
processes take the per-GPU lock as replicas' procs would. And when a TP replica may use vLLM's
custom all-reduce."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

from rlactors.engines.vllm_engine import one_start_per_gpu

HOLD_S = 0.5
JOIN_S = 600


def start(visible: str, tp: int, times, ready, together) -> None:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    ready.wait()  # every process imported and ready: they ask for the locks at once
    with one_start_per_gpu(tp):
        began = time.monotonic()
        if together is None:
            time.sleep(HOLD_S)
        else:
            together.wait(timeout=JOIN_S)  # broken, so failing, unless the others hold their locks too
        times.append((visible, began, time.monotonic()))


def run_together(*placements: tuple[str, int], together: tuple[str, ...] = ()) -> list[tuple[str, float, float]]:
    """Starts a process per (CUDA_VISIBLE_DEVICES, tp); those named in `together` wait inside the lock
    until all of them are inside, which only engines that do not wait for one another can do."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        times, ready = manager.list(), manager.Barrier(len(placements))
        inside = manager.Barrier(len(together)) if together else None
        procs = [context.Process(target=start,
                                 args=(visible, tp, times, ready, inside if visible in together else None))
                 for visible, tp in placements]
        for p in procs:
            p.start()
        for p in procs:
            # Bounded for a hang, not for speed: spawned processes import torch, slowly on a busy machine.
            p.join(timeout=JOIN_S)
            assert p.exitcode == 0
        return sorted(times, key=lambda t: t[1])


def overlap(a, b) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def test_engines_on_one_gpu_start_in_turn_and_on_other_gpus_at_once():
    first, second = run_together(("7", 1), ("7", 1))
    assert not overlap(first, second)
    # A TP-2 engine on GPUs 6 and 7 waits for one on GPU 7; engines on GPUs 5 and 4 do not wait.
    times = run_together(("6,7", 2), ("7", 1), ("5", 1), ("4", 1), together=("5", "4"))
    spans = {visible: (visible, began, ended) for visible, began, ended in times}
    assert not overlap(spans["6,7"], spans["7"])


def test_a_process_forked_while_starting_does_not_keep_the_lock(monkeypatch):
    """vLLM's engine core may be forked while its engine holds the lock, and lives on."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with one_start_per_gpu(1):
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
    try:
        # Another engine's start on that GPU, in a process of its own, gets the lock at once.
        subprocess.run([sys.executable, "-c", "from rlactors.engines.vllm_engine import one_start_per_gpu\n"
                        "with one_start_per_gpu(1): pass"], check=True, timeout=JOIN_S)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_tensor_parallel_replica_all_reduces_through_nccl_under_expandable_segments():
    from rlactors.engines.vllm_engine import custom_all_reduce_works

    assert custom_all_reduce_works(2, "") and custom_all_reduce_works(2, "expandable_segments:False")
    assert not custom_all_reduce_works(2, "expandable_segments:True")
    assert not custom_all_reduce_works(4, "max_split_size_mb:512, expandable_segments:True")
    assert custom_all_reduce_works(1, "expandable_segments:True")  # one GPU: nothing to all-reduce
