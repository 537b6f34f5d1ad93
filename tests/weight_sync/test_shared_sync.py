"""Weight sync through a shared buffer: the trainer's buffer, mapped by a replica, gives it the
packed weights bit for bit and refuses a flipped bit; and SharedSync's decisions against
stand-ins for the trainer and the router (a replica that died, a restart awaited, a rejection).
With real procs (a replica killed mid-push, its restart mapping the buffer again, a corrupted
buffer): tests/faults/test_training_faults.py; on a GPU: tests/test_gpu_system.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import warnings

import pytest
import torch
from monarch.actor import ActorError
from support.packed_weights import small_weights
from support.stand_ins import Rank0

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.async_engine import AsyncEngine
from rlactors.engines.native import NativeEngine
from rlactors.models.checkpoint import load_state_dict
from rlactors.procs.placement import set_expandable_segments
from rlactors.types import SamplingParams
from rlactors.weight_sync.checksum import ChecksumMismatch
from rlactors.weight_sync.packed import PackedLayout
from rlactors.weight_sync.shared import SharedBuffer, SharedReceiver, _plain_segments, map_buffer
from rlactors.weight_sync.sync import NoReplicaUp, SharedSync, WeightSyncError


def test_a_mapped_shared_buffer_gives_the_packed_weights_and_refuses_a_flipped_bit():
    weights = small_weights()
    layout = PackedLayout.of(weights)
    shared = SharedBuffer(layout, torch.device("cpu"))
    assert os.readlink(f"/proc/self/fd/{shared.handle.fd}") == "/memfd:rlactors-weights (deleted)"  # no file
    layout.pack(weights, shared.buffer)
    checksum = layout.checksum(shared.buffer)
    receiver = SharedReceiver()
    views = receiver.verified_views(shared.handle, 1, checksum)
    assert all(torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype
               for name, tensor in weights.items())
    mapping = receiver.buffer
    assert mapping.data_ptr() != shared.buffer.data_ptr()  # a mapping of its own, of the same memory
    shared.buffer.view(torch.int32)[7] ^= 1 << 3  # after the checksum
    with pytest.raises(ChecksumMismatch, match=r"^weights version 2: shared buffer checksum [0-9a-f]{32}, trainer "
                                               r"sent [0-9a-f]{32}; keeping the previous weights$"):
        receiver.verified_views(shared.handle, 2, checksum)
    assert receiver.buffer is mapping  # mapped once per buffer
    with pytest.raises(RuntimeError, match="on host another-host, this replica on .*: shared weight sync needs one"):
        map_buffer(dataclasses.replace(shared.handle, host="another-host"))


def test_the_shared_buffer_is_allocated_in_plain_segments_under_expandable_ones(monkeypatch):
    # CUDA IPC hands out an expandable segment only by file descriptor, which another process may not take
    settings = torch._C._accelerator_getAllocatorSettings
    before = settings()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    set_expandable_segments(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing deprecated on the way
            with _plain_segments():
                assert settings() == "expandable_segments:False"
        assert settings() == "expandable_segments:True"
    finally:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")


def test_a_replica_returns_from_a_shared_load_once_its_model_holds_a_copy_of_the_weights(tiny_ckpt):
    """Drain mode with a request in flight: the request ends on the old weights, then the load
    copies the buffer into the model, then the call returns; the trainer may then repack."""
    config = GeneratorConfig(replicas=1, max_model_len=64, kv_cache_tokens=256)
    engine = AsyncEngine(NativeEngine.from_config(config, ModelConfig(path=str(tiny_ckpt)), device="cpu"))
    weights = {name: tensor * 2 for name, tensor in load_state_dict(tiny_ckpt).items()}
    layout = PackedLayout.of(weights)
    shared = SharedBuffer(layout, torch.device("cpu"))
    checksum = layout.checksum(layout.pack(weights, shared.buffer))

    async def load_while_generating():
        sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
        generating = asyncio.ensure_future(engine.generate([1, 2, 3], sampling, "in flight"))
        await asyncio.sleep(0)  # queued
        loaded = await engine.updates.load_shared(shared.handle, 1, checksum, "drain")
        assert generating.done() and generating.result().versions == [0] * 8
        params = engine.engine._loaded_parameters()
        assert loaded["version"] == 1 and engine.engine.version == 1
        assert all(torch.equal(params[name], tensor) for name, tensor in weights.items())
        shared.buffer.zero_()  # the trainer repacks: the model keeps its copy
        assert all(torch.equal(params[name], tensor) for name, tensor in weights.items())
        with pytest.raises(ChecksumMismatch, match="^weights version 2: shared buffer checksum"):
            await engine.updates.load_shared(shared.handle, 2, checksum, "drain")
        assert engine.engine.version == 1 and not engine.updates.waiting
        await engine.close()

    asyncio.run(load_while_generating())


class Endpoint:
    """Answers each call with the next of `results` (the last once they run out); raises an
    exception; records the calls."""

    def __init__(self, *results):
        self.results, self.calls = list(results), []

    async def call(self, *args):
        self.calls.append(args)
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if isinstance(result, BaseException):
            raise result
        return result

    call_one = call


def packed(version=1):
    return Rank0({"handle": "handle", "version": version, "checksum": "c" * 32, "bytes": 8.0, "pack_s": 0.1,
                  "checksum_s": 0.2})


def loaded(*versions):
    return {"version": 1, "seconds": 0.5, "replicas": [{"version": v, "verify_s": 0.3, "apply_s": 0.4}
                                                       for v in versions]}


class Trainer:
    def __init__(self, *packs):
        self.share_weights = Endpoint(*(packs or (packed(),)))


class Router:
    def __init__(self, loads, awaiting=({"awaiting": [], "restarting": []},)):
        self.load_shared_weights = Endpoint(*loads)
        self.awaiting_weights = Endpoint(*awaiting)


def push(router, trainer=None, restart_dead=False):
    sync = SharedSync(trainer or Trainer(), router, "bfloat16", "drain", restart_dead)
    return sync, asyncio.run(sync.push(1))


def test_a_push_has_the_replicas_load_the_packed_buffer_and_times_both_sides():
    router = Router([loaded(1, 1)])
    sync, timings = push(router)
    assert router.load_shared_weights.calls == [("handle", 1, "c" * 32, "drain")]
    assert sync.version == 1
    assert (timings["bytes"], timings["pack_s"], timings["checksum_s"], timings["replica_verify_s"],
            timings["replica_load_s"]) == (8.0, 0.1, 0.2, 0.3, 0.4)


def test_a_push_of_another_version_than_the_trainer_holds_is_refused_before_any_replica_loads():
    router = Router([loaded(1)])
    with pytest.raises(WeightSyncError, match="^weight sync of policy version 1 failed: the trainer holds version 2$"):
        push(router, Trainer(packed(version=2)))
    assert router.load_shared_weights.calls == []


def test_a_replica_that_rejects_the_buffer_stops_the_push_naming_it():
    rejected = ActorError(RuntimeError("weights version 1 rejected by replica 0: ChecksumMismatch(...)"))
    with pytest.raises(WeightSyncError, match=r"^weight sync of policy version 1 failed: weights version 1 rejected "
                                              r"by replica 0"):
        push(Router([rejected]))


def test_a_push_that_a_dead_replica_missed_completes_on_the_others():
    assert push(Router([loaded(1)]))[0].version == 1  # the router marked the other one dead


def test_a_push_that_every_replica_died_during_raises_no_replica_up_without_a_restart():
    with pytest.raises(NoReplicaUp, match="^weight sync of policy version 1: no generator replica is up to load it$"):
        push(Router([loaded()]), restart_dead=True)  # nothing restarting


def test_with_restart_dead_a_push_whose_only_replica_died_waits_for_its_restart_and_loads_again(monkeypatch):
    monkeypatch.setattr("rlactors.weight_sync.sync.BROADCAST_WATCH_S", 0.01)
    router = Router([loaded(), loaded(1)], awaiting=({"awaiting": [], "restarting": [0]},
                                                     {"awaiting": [0], "restarting": []}))
    sync, _ = push(router, restart_dead=True)
    assert sync.version == 1 and len(router.load_shared_weights.calls) == 2 and len(router.awaiting_weights.calls) == 2


@pytest.mark.parametrize("awaiting", [[], [1]])
def test_a_push_is_due_for_a_new_version_or_for_a_restarted_replica_that_awaits_weights(awaiting):
    sync = SharedSync(Trainer(), Router([loaded(1)], ({"awaiting": awaiting, "restarting": []},)), "bfloat16",
                      "drain", True)
    assert asyncio.run(sync.due(1)) and asyncio.run(sync.due(0)) == bool(awaiting)
