"""Shared fixtures: random-init tiny checkpoints of each model family, built once per test session,
and the short whole run the whole-run tests compare against; on a GPU machine, every test module
gives back the GPU memory it took."""

import gc
import os
import time
from pathlib import Path

import pytest
import torch

from rlactors.procs.supervision import use_fast_supervision

# Actor procs inherit this environment: Monarch's supervision as the CLI sets it (forced: the fault
# tests' detection times, and their slow procs, depend on it), and each proc kept to one intra-op
# thread on the 2-core CI box, where 2-thread procs contend.
use_fast_supervision(force=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rlactors.models.tiny import make_tiny_checkpoint  # noqa: E402
from rlactors.run.memory_plan import gpu_processes  # noqa: E402


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """``family_ckpt(family, tie=True)``: a tiny checkpoint of ``family`` (``size="tiny"``: GQA
    4q/2kv, fp32, the ChatML tokenizer; seed 0 tied, 1 untied), built once per session."""
    built: dict[tuple[str, bool], Path] = {}

    def get(family: str, tie: bool = True) -> Path:
        if (family, tie) not in built:
            out = tmp_path_factory.mktemp(f"tiny_{family}_{'tied' if tie else 'untied'}")
            built[family, tie] = make_tiny_checkpoint(out, size="tiny", seed=0 if tie else 1,
                                                      tie_word_embeddings=tie, family=family)
        return built[family, tie]

    return get


@pytest.fixture(scope="session")
def tiny_ckpt(family_ckpt) -> Path:
    """Tiny Qwen3 (tied embeddings, GQA 4q/2kv, fp32) with its tokenizer and chat template."""
    return family_ckpt("qwen3")


@pytest.fixture(scope="session")
def tiny_ckpt_untied(family_ckpt) -> Path:
    """Like ``tiny_ckpt`` but with a separate ``lm_head.weight``."""
    return family_ckpt("qwen3", tie=False)


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """A test that sets torch's thread count (a warm start's main does, for a reproducible
    checkpoint) leaves the next test the count it found: the order of a sum's terms follows it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# What a module may keep on a GPU after its last test: the CUDA context's own allocations
# (cuBLAS workspaces, kernel libraries loaded on first use: 1.3 GiB after the attention kernels on
# an H100) but no engine (the smallest test engine takes several GiB), model or cached block.
GPU_MEMORY_KEPT_BYTES = 2 << 30


def _held_by_this_process() -> str:
    """Where this process's share of kept GPU memory is: its caching allocator's tensors and
    reserve, and its largest CUDA tensors that Python still reaches (what the allocator does not
    hold is kept beside it: NCCL, CUDA graphs' pools, libraries)."""
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                tensors.append(obj)
        except Exception:  # noqa: BLE001 - an object whose isinstance check fails is no tensor of ours
            continue
    largest = sorted(tensors, key=lambda t: t.untyped_storage().nbytes(), reverse=True)[:5]
    return (f"this process's allocator: {torch.cuda.memory_allocated() / 2**30:.2f} GiB in tensors, "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved; {len(tensors)} CUDA tensors reachable"
            + "".join(f", {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB" for t in largest))


def _free_gpu_bytes() -> list[int]:
    gc.collect()
    torch.cuda.empty_cache()
    return [torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count())]


@pytest.fixture(scope="module", autouse=True)
def gpu_memory_given_back(request):
    """On a GPU machine: each module leaves every GPU with the free memory it found (engines in
    this process closed, engine and actor processes exited, the caching allocator emptied), so
    a later test (a vLLM engine that asks for a share of the card) finds the card as a fresh
    process would. Processes exit a little after they are told to: wait up to 30 s for them.
    What other processes, there before the module started, took or gave back meanwhile (another
    job on the same GPU) is not the module's."""
    if not torch.cuda.is_available():
        yield
        return
    before, others = _free_gpu_bytes(), gpu_processes()
    others.pop(os.getpid(), None)
    yield
    deadline = time.monotonic() + 30
    while True:
        now = gpu_processes()
        theirs = sum(now.get(pid, (0, ""))[0] - mib for pid, (mib, _) in others.items()) * 2**20
        held = [b - a - theirs for b, a in zip(before, _free_gpu_bytes())]
        if max(held) <= GPU_MEMORY_KEPT_BYTES or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert max(held) <= GPU_MEMORY_KEPT_BYTES, (
        f"{request.module.__name__} kept GPU memory: " + ", ".join(f"GPU {d}: {h / 2**30:.2f} GiB" for d, h in
                                                                   enumerate(held) if h > GPU_MEMORY_KEPT_BYTES)
        + f"; processes on the GPUs (this one is {os.getpid()}): "
        + ("; ".join(f"{pid} {mib} MiB {command!r}" for pid, (mib, command) in now.items()) or "none listed")
        + f"; {_held_by_this_process()}")


@pytest.fixture(scope="session")
def tool_policy_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny Qwen3 after memorising one calculator tool-calling conversation (support.tool_policy)."""
    from support.tool_policy import train_tool_policy

    return train_tool_policy(tiny_ckpt, tmp_path_factory.mktemp("tool_policy"))


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> tuple[Path, list[dict[str, float]]]:
    """One uninterrupted short run on this host (support.demo_runs, the default sync mode and
    weights by messages, checkpointed at every step): its run dir and step metrics, the reference
    of the whole-run tests that only read them (or resume a copy of its dir)."""
    import asyncio

    from support.demo_runs import WARM_CHECKPOINT, short_run_overrides

    from rlactors.config import load_config
    from rlactors.run.controller import Controller

    run_dir = tmp_path_factory.mktemp("short_run")
    overrides = short_run_overrides(WARM_CHECKPOINT, run_dir, "controller.checkpoint_every=1")
    return run_dir, asyncio.run(Controller(load_config(None, overrides)).run())
