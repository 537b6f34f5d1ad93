"""Colocated turns (rlactors.run.turns, generator.sleep): the controller's update sequence, driven with
a real AsyncEngine over the native engine that records what it is asked, in order, and refuses to
generate or load while asleep (as vLLM's sleeping engine cannot)."""

import asyncio
from types import SimpleNamespace

import pytest

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.async_engine import AsyncEngine
from rlactors.engines.native import NativeEngine
from rlactors.engines.vllm_engine import without_expandable_segments
from rlactors.models.checkpoint import load_state_dict
from rlactors.run.turns import NoTurns, Turns, take_turns
from rlactors.types import SamplingParams


class RecordingEngine(NativeEngine):
    def __init__(self, model, config, calls):
        super().__init__(model, config)
        self.calls, self.asleep = calls, set()

    def add_request(self, request_id, prompt_token_ids, sampling, streamed=False):
        assert not self.asleep, f"generate while {sorted(self.asleep)} asleep"
        self.calls.append("generate")
        super().add_request(request_id, prompt_token_ids, sampling, streamed)

    def load_weights(self, named_tensors, version):
        assert "weights" not in self.asleep, "weights loaded while asleep"
        self.calls.append("load")
        super().load_weights(named_tensors, version)

    def sleep(self):
        self.calls.append("sleep")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(f"wake {','.join(tags or ['all'])}")
        self.asleep -= set(tags or ["weights", "kv_cache"])


def endpoint(fn):
    """A stand-in for an actor endpoint: `call_one` runs `fn`; `call` (a whole-mesh call) returns
    its result as a one-point ValueMesh would (`placement.first_value` reads it)."""
    async def call(*args):
        result = await fn(*args)
        return SimpleNamespace(extent={}, item=lambda: result)
    return SimpleNamespace(call_one=fn, call=call)


@pytest.fixture
def replica(tiny_ckpt):
    calls = []
    config = GeneratorConfig(replicas=1, max_model_len=64, kv_cache_tokens=256)
    model = NativeEngine.from_config(config, ModelConfig(path=str(tiny_ckpt)), device="cpu").model
    return AsyncEngine(RecordingEngine(model, config, calls)), calls, load_state_dict(tiny_ckpt)


async def one_step(turns, engine, calls, weights):
    """Generate, then the trainer's part of a step as the controller runs it, then generate."""
    sampling = SamplingParams(max_tokens=2, temperature=1.0, seed=0)
    await engine.generate([1, 2, 3], sampling, "before")

    async def train():
        calls.append("train")
        return {"loss": 0.5}

    async def checkpoint():
        calls.append("checkpoint")

    async def sync():
        calls.append("sync")
        return await engine.updates.update_weights(1, weights)

    update = await take_turns(turns, train, checkpoint, sync)
    await engine.generate([1, 2, 3], sampling, "after")
    await engine.close()
    return update


def test_colocated_turns_sleep_for_training_and_load_weights_before_the_kv_cache_wakes(replica):
    engine, calls, weights = replica
    router = SimpleNamespace(sleep=endpoint(engine.sleep), wake_up=endpoint(engine.wake_up))

    released = iter([{"peak_allocated_gib": 1.5, "peak_reserved_gib": 2.0, "held_gib": 0.5},
                     {"peak_allocated_gib": 0.25, "peak_reserved_gib": 0.5, "held_gib": 0.75}])

    async def release_memory():
        calls.append("release_memory")
        return next(released)

    update = asyncio.run(one_step(Turns(SimpleNamespace(release_memory=endpoint(release_memory)), router),
                                  engine, calls, weights))
    assert calls == ["generate", "sleep", "train", "checkpoint", "release_memory", "wake weights", "sync",
                     "release_memory", "load", "wake kv_cache", "generate"]
    assert update.trained == {"loss": 0.5} and update.synced["version"] == 1
    # the step's peak (not the sync's), and what the trainer holds while the KV cache is awake
    assert update.turns["memory/trainer_peak_gib"] == 1.5 and update.turns["memory/trainer_held_gib"] == 0.75
    assert update.turns["memory/trainer_peak_reserved_gib"] == 2.0
    assert set(update.turns) == {"turns/sleep_s", "turns/wake_weights_s", "turns/wake_kv_cache_s",
                                 "memory/trainer_peak_gib", "memory/trainer_peak_reserved_gib",
                                 "memory/trainer_held_gib"}
    assert set(update.seconds) == {"train", "checkpoint", "sync"}


def test_without_sleep_the_engines_keep_their_memory(replica):
    engine, calls, weights = replica
    update = asyncio.run(one_step(NoTurns(), engine, calls, weights))
    assert calls == ["generate", "train", "checkpoint", "sync", "load", "generate"]
    assert update.turns == {}


def test_an_engine_does_not_sleep_with_requests_in_flight(replica):
    engine, calls, _ = replica

    async def sleep_while_generating():
        sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=0)
        generating = asyncio.ensure_future(engine.generate([1, 2, 3], sampling, "long"))
        await asyncio.sleep(0)  # queued
        with pytest.raises(RuntimeError, match=r"^cannot sleep with 1 request\(s\) in flight$"):
            await engine.sleep()
        await generating
        await engine.close()

    asyncio.run(sleep_while_generating())
    assert "sleep" not in calls


def test_a_sleeping_vllm_gets_no_expandable_segments():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
               "PYTORCH_ALLOC_CONF": " expandable_segments : True", "OTHER": "expandable_segments:True"}
    without_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "",
                       "OTHER": "expandable_segments:True"}
