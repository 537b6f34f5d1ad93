"""Generator serving: the asyncio engine loop (weight updates, loop death, bad input, close), the
router's replica choice, and the real thing: GeneratorRouter + 2 native Generator replicas in
Monarch procs on CPU."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch
from monarch.actor import ActorError, this_host
from support.router_procs import stats_when
from support.threads import one_thread  # noqa: F401 - this module's autouse fixture

from rlactors.actors.router import GeneratorRouter, ReplicaPicker
from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.async_engine import AsyncEngine
from rlactors.engines.native import NativeEngine
from rlactors.models.checkpoint import from_pretrained
from rlactors.types import EngineDeadError, SamplingParams
from rlactors.weight_sync.broadcast import BroadcastBroken
from rlactors.weight_sync.checksum import ChecksumMismatch, state_checksum

VOCAB = 1024


def prompts(n: int, low: int = 1, high: int = 60, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items() if k != "lm_head.weight"}


def reference_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        hidden = model.forward_packed(ids, torch.arange(len(ids)), backend="sdpa")
        return model.token_logprobs(hidden[:-1], ids[1:])[len(prompt) - 1:]


def async_engine(ckpt, mode: str = "drain") -> AsyncEngine:
    model = from_pretrained(ckpt, dtype="float32")
    return AsyncEngine(NativeEngine(model, GeneratorConfig(max_num_seqs=8, max_num_tokens=256, kv_cache_tokens=2048,
                                                           max_model_len=512)), default_update_mode=mode)


async def until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


# -- AsyncEngine --------------------------------------------------------------------------------


def test_drain_update_returns_once_verified_and_loads_after_in_flight_requests(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        new = perturbed(engine.engine.model.state_dict(), seed=1)
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "old"))
        await until(lambda: engine.stats()["generated_tokens"] >= 2)
        timings = await engine.updates.update_weights(1, new, state_checksum(new))
        # Verified and returned while the old request still runs; a request sent now waits for the load.
        assert timings["version"] == 1 and timings["mode"] == "drain" and timings["verify_s"] > 0
        assert not running.done() and engine.stats()["updating"] and engine.stats()["version"] == 0
        later = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "new"))
        old = await running
        assert old.versions == [0] * 200
        fresh = await later
        assert fresh.versions == [1] * 4 and fresh.timings["queue_s"] > 0
        loaded = engine.stats()["last_update"]
        assert loaded["version"] == 1 and loaded["wait_s"] > 0 and engine.stats()["updates"] == 1
        await engine.close()

    asyncio.run(main())


def test_a_newer_version_replaces_one_still_waiting_for_its_drain(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        versions = [perturbed(engine.engine.model.state_dict(), seed=s) for s in (1, 2)]
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "old"))
        await until(lambda: engine.stats()["generated_tokens"] >= 2)
        await engine.updates.update_weights(1, versions[0], state_checksum(versions[0]))
        between = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "between"))
        await engine.updates.update_weights(2, versions[1], state_checksum(versions[1]))
        assert not running.done() and engine.stats()["superseded"] == 1
        assert (await running).versions == [0] * 200
        # Sent after version 1 was accepted: served by a version at least as new, here 2.
        assert (await between).versions == [2] * 4
        stats = engine.stats()
        assert stats["version"] == 2 and stats["updates"] == 1 and stats["last_update"]["version"] == 2
        loaded = engine.engine.model.state_dict()
        assert all(torch.equal(loaded[k], t) for k, t in versions[1].items())
        await engine.close()

    asyncio.run(main())


def test_busy_time_counts_engine_steps_only(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        start = time.perf_counter()
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=40), "r")
        generating = time.perf_counter() - start
        busy = engine.stats()["busy_s"]
        await asyncio.sleep(0.3)  # no request: the engine idles and its busy time stays put
        assert 0 < busy <= generating and engine.stats()["busy_s"] == busy
        await engine.close()

    asyncio.run(main())


def test_hot_swap_continues_in_flight_requests_on_the_new_weights(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt, mode="hot_swap")
        new = perturbed(engine.engine.model.state_dict(), seed=1)
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "r"))
        await until(lambda: engine.stats()["generated_tokens"] >= 3)
        timings = await engine.updates.update_weights(3, new)
        completion = await running
        switch = completion.versions.index(3)
        assert 3 <= switch < 200 and timings["mode"] == "hot_swap"
        assert completion.versions == [0] * switch + [3] * (200 - switch)
        assert engine.stats()["version"] == 3
        await engine.close()

    asyncio.run(main())


def test_an_engine_without_hot_swaps_refuses_one_and_keeps_serving(tiny_ckpt):
    """An engine that tags a request's tokens with one version (vLLM started for drain updates)."""
    async def main():
        engine = async_engine(tiny_ckpt)
        engine.engine.hot_swaps = False
        new = perturbed(engine.engine.model.state_dict(), seed=1)
        with pytest.raises(ValueError, match="cannot hot swap"):
            await engine.updates.update_weights(3, new, mode="hot_swap")
        await engine.updates.update_weights(3, new)  # a drain update is fine
        completion = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "r")
        assert completion.versions == [3] * 4
        await engine.close()

    asyncio.run(main())


def test_checksum_mismatch_or_bad_weights_keep_the_old_version_serving(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        new = perturbed(engine.engine.model.state_dict(), seed=1)
        checksum = state_checksum(new)
        corrupted = dict(new)
        corrupted["model.norm.weight"] = corrupted["model.norm.weight"].clone()
        corrupted["model.norm.weight"][0] += 1
        with pytest.raises(ChecksumMismatch, match="still serving version 0"):
            await engine.updates.update_weights(1, corrupted, checksum)
        with pytest.raises(ValueError, match="missing"):
            await engine.updates.update_weights(1, {"model.norm.weight": new["model.norm.weight"]})
        with pytest.raises(ValueError, match="update mode"):
            await engine.updates.update_weights(1, new, mode="sometimes")
        completion = await engine.generate([5, 6], SamplingParams(max_tokens=3), "r")
        assert completion.versions == [0, 0, 0] and engine.stats()["healthy"]
        await engine.close()

    asyncio.run(main())


class StagingEngine(NativeEngine):
    """The native engine as its own broadcast receiver; `wire` stands in for the NCCL broadcast
    (the vLLM engine's transport, run on the GPU machines): the tensors that arrive and the
    checksum the trainer sent with them (`send`). Its one receive buffer, `staged`, is what a load
    reads; `load_gate`, when set, holds a load until released."""

    stages_concurrently = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wire: dict[str, torch.Tensor] = {}
        self.wire_checksum = ""
        self.staged: dict[str, torch.Tensor] = {}
        self.side_threads: set[str] = set()
        self.stages = 0
        self.load_gate: threading.Event | None = None
        self.joins: list[tuple[str, tuple]] = []
        self.break_next = False  # the next receive's group breaks halfway through the buffer

    def broadcast_receiver(self):
        return self

    def join(self, *group):
        self.joins.append((threading.current_thread().name, group))
        return [group[2]]

    def send(self, tensors: dict[str, torch.Tensor], sent: dict[str, torch.Tensor] | None = None) -> None:
        """The trainer broadcasts `sent` (default: `tensors`); `tensors` arrive."""
        self.wire, self.wire_checksum = tensors, state_checksum(tensors if sent is None else sent)

    def receive(self, version):
        self.side_threads.add(threading.current_thread().name)
        self.stages += 1
        self.staged = {k: v.clone() for k, v in self.wire.items()}
        if self.break_next:
            self.break_next = False
            self.staged = {k: torch.zeros_like(v) for k, v in self.staged.items()}
            raise BroadcastBroken("the weight broadcast group broke: Connection closed by peer")
        if state_checksum(self.staged) != self.wire_checksum:
            raise ChecksumMismatch(f"weights version {version}: checksum differs")
        return {"receive_verify_s": 0.0}

    def load(self, version):
        if self.load_gate is not None:
            self.load_gate.wait()
        self.load_weights(self.staged, version)
        return {"load_s": 0.0}


def staging_engine(ckpt) -> AsyncEngine:
    model = from_pretrained(ckpt, dtype="float32")
    return AsyncEngine(StagingEngine(model, GeneratorConfig(max_num_seqs=8, max_num_tokens=256, kv_cache_tokens=2048,
                                                            max_model_len=512)))


def test_broadcast_weights_are_verified_at_once_and_the_newest_is_loaded_after_the_drain(tiny_ckpt):
    async def main():
        engine = staging_engine(tiny_ckpt)
        versions = [perturbed(engine.engine.model.state_dict(), seed=s) for s in (1, 2)]
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "old"))
        await until(lambda: engine.stats()["generated_tokens"] >= 2)

        corrupted = {**versions[0], "model.norm.weight": versions[0]["model.norm.weight"] + 1}  # in transit
        engine.engine.send(corrupted, sent=versions[0])
        with pytest.raises(ChecksumMismatch, match="version 1"):
            await engine.updates.receive_weights(1)
        assert not engine.stats()["updating"]

        engine.engine.send(versions[0])
        staged = await engine.updates.receive_weights(1)
        # Verified while the old request still runs; it finishes on the old weights, and a request
        # sent now waits for the load.
        assert staged["version"] == 1 and not running.done() and engine.stats()["updating"]
        later = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "new"))
        # Version 2 overwrites the buffer before version 1 was loaded: no wait for the drain.
        engine.engine.send(versions[1])
        await engine.updates.receive_weights(2)
        assert not running.done() and engine.stats()["superseded"] == 1
        assert (await running).versions == [0] * 200
        assert (await later).versions == [2] * 4
        stats = engine.stats()
        assert stats["version"] == 2 and stats["updates"] == 1 and stats["last_update"]["load_s"] == 0.0
        assert engine.engine.side_threads == {"engine-side_0"}

        # Verified weights that then fail to load leave the engine dead, not half-loaded and serving.
        engine.engine.send({"model.norm.weight": versions[1]["model.norm.weight"]})  # not a whole set
        await engine.updates.receive_weights(3)
        await until(lambda: not engine.stats()["healthy"])
        with pytest.raises(EngineDeadError):
            await engine.generate([5, 6], SamplingParams(max_tokens=2), "after")
        await engine.close()

    asyncio.run(main())


def test_a_receive_never_overwrites_the_buffer_while_it_loads(tiny_ckpt):
    async def main():
        engine = staging_engine(tiny_ckpt)
        versions = [perturbed(engine.engine.model.state_dict(), seed=s) for s in (1, 2)]
        engine.engine.load_gate = threading.Event()
        engine.engine.send(versions[0])
        await engine.updates.receive_weights(1)  # nothing in flight: loads at once
        await asyncio.sleep(0.05)
        engine.engine.send(versions[1])
        second = asyncio.create_task(engine.updates.receive_weights(2))
        await asyncio.sleep(0.05)
        assert not second.done() and engine.engine.stages == 1  # waits for the load of version 1
        engine.engine.load_gate.set()
        await second
        await until(lambda: engine.stats()["updates"] == 2)
        assert engine.stats()["version"] == 2 and engine.stats()["superseded"] == 0
        await engine.close()

    asyncio.run(main())


def test_a_new_weight_group_is_joined_beside_the_drain_and_keeps_the_waiting_version(tiny_ckpt):
    async def main():
        engine = staging_engine(tiny_ckpt)
        version = perturbed(engine.engine.model.state_dict(), seed=1)
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "old"))
        await until(lambda: engine.stats()["generated_tokens"] >= 2)
        engine.engine.send(version)
        await engine.updates.receive_weights(1)
        # A member died: the controller forms a new group while version 1 waits for the drain.
        assert await engine.updates.join_weight_group("10.0.0.1", 29500, 1, 2, None) == [1]
        assert not running.done() and engine.stats()["updating"]
        assert (await running).versions == [0] * 200
        await until(lambda: engine.stats()["updates"] == 1)
        assert engine.stats()["version"] == 1
        assert engine.engine.joins == [("engine-side_0", ("10.0.0.1", 29500, 1, 2, None))]
        await engine.close()

    asyncio.run(main())


async def version_1_accepted_beside_requests(tiny_ckpt):
    """A staging engine generating a long request on version 0 that has accepted version 1 (not
    loaded yet), and a request that waits for version 1; the next version's weights too."""
    engine = staging_engine(tiny_ckpt)
    versions = [perturbed(engine.engine.model.state_dict(), seed=s) for s in (1, 2)]
    running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "old"))
    await until(lambda: engine.stats()["generated_tokens"] >= 2)
    engine.engine.send(versions[0])
    await engine.updates.receive_weights(1)
    waiting = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "promised-v1"))
    return engine, versions, running, waiting


def test_a_bad_receive_over_an_accepted_version_kills_the_replica(tiny_ckpt):
    async def main():
        engine, versions, running, waiting = await version_1_accepted_beside_requests(tiny_ckpt)
        engine.engine.send({**versions[1], "model.norm.weight": versions[1]["model.norm.weight"] + 1},
                           sent=versions[1])
        with pytest.raises(ChecksumMismatch):
            await engine.updates.receive_weights(2)
        # Version 1 was accepted, then its buffer overwritten: the in-flight request finishes on
        # version 0, and the replica dies rather than serve version 0 to requests promised version 1.
        assert (await running).versions == [0] * 200
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting, timeout=30)
        assert not engine.stats()["healthy"] and engine.stats()["version"] == 0
        await engine.close()

    asyncio.run(main())


def test_a_broken_receive_over_an_accepted_version_holds_it_until_the_broadcast_goes_again(tiny_ckpt):
    async def main():
        engine, versions, running, waiting = await version_1_accepted_beside_requests(tiny_ckpt)
        engine.engine.send(versions[1])
        engine.engine.break_next = True
        with pytest.raises(BroadcastBroken):  # a member died: the push forms a new group and goes again
            await engine.updates.receive_weights(2)
        # Version 1's buffer was overwritten: it is never loaded, and nothing new is admitted.
        assert (await running).versions == [0] * 200
        await asyncio.sleep(0.1)
        assert engine.stats()["healthy"] and engine.stats()["updating"] and not waiting.done()
        assert engine.stats()["version"] == 0
        await engine.updates.join_weight_group("10.0.0.1", 29501, 1, 2, None)
        await engine.updates.receive_weights(2)
        assert (await asyncio.wait_for(waiting, timeout=30)).versions == [2] * 4
        assert engine.stats()["version"] == 2 and engine.stats()["superseded"] == 1
        await engine.close()

    asyncio.run(main())


def test_bad_requests_fail_alone_and_close_aborts_the_rest(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        long = asyncio.create_task(engine.generate([5, 6], SamplingParams(max_tokens=400), "long"))
        bad = [engine.generate([], SamplingParams(), "empty"),
               engine.generate(list(range(3, 515)), SamplingParams(), "too-long"),
               engine.generate([5], {"max_tokens": 3, "temprature": 0.5}, "typo"),
               engine.generate([5], {"max_tokens": 0}, "zero")]
        results = await asyncio.gather(*bad, return_exceptions=True)
        messages = ["prompt_token_ids is empty", "max_model_len=512", "unknown SamplingParams key",
                    "max_tokens must be >= 1"]
        for result, message in zip(results, messages):
            assert isinstance(result, ValueError) and message in str(result)
        good = await engine.generate([7, 8], {"max_tokens": 5, "temperature": 0.0}, "good")
        assert len(good.token_ids) == 5 and not long.done()
        await engine.close()
        aborted = await long
        assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 400
        with pytest.raises(EngineDeadError, match="closed"):
            await engine.generate([5], SamplingParams(), "after-close")

    asyncio.run(main())


def test_engine_loop_death_fails_every_pending_request_and_reports_unhealthy(tiny_ckpt):
    async def main():
        engine = async_engine(tiny_ckpt)
        calls = [asyncio.create_task(engine.generate([5, 6, i], SamplingParams(max_tokens=300), f"r{i}"))
                 for i in range(3, 8)]
        await until(lambda: engine.stats()["generated_tokens"] >= 5)
        engine.engine.cache.kv = torch.empty(0)  # injected fault: the next step raises
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "engine loop died" in str(r) for r in results)
        stats = engine.stats()
        assert not stats["healthy"] and stats["error"]
        with pytest.raises(EngineDeadError):
            await engine.generate([5], SamplingParams(), "later")
        with pytest.raises(EngineDeadError):
            await engine.updates.update_weights(1, {})
        await engine.close()  # collects the loop's error, which would otherwise be logged later, elsewhere

    asyncio.run(main())


# -- replica choice -----------------------------------------------------------------------------


def test_picker_is_least_loaded_with_sticky_sessions_and_fallbacks():
    picker = ReplicaPicker(sticky_factor=2.0, sticky_slack=2, max_sessions=2)
    assert picker.pick([3, 1, 2]) == 1
    assert {picker.pick([0, 0]) for _ in range(4)} == {0, 1}  # ties rotate
    assert picker.pick([5, 0, 1], "s") == 1
    assert picker.pick([0, 4, 0], "s") in (0, 2)  # 4 > 2 * 0 + 2: the session moves
    home = picker.sessions["s"]
    loads = [1, 1, 1]
    loads[home] = 4  # 4 <= 2 * 1 + 2: stays
    assert picker.pick(loads, "s") == home
    dead = [None if i == home else 0 for i in range(3)]
    assert picker.pick(dead, "s") != home and picker.pick([0, 0, 0], "s", exclude=frozenset({0, 1, 2})) is None
    picker.pick([0, 0, 0], "t")
    picker.pick([0, 0, 0], "u")
    assert list(picker.sessions) == ["t", "u"]  # least recently used session forgotten


# -- Monarch: router + 2 native replicas --------------------------------------------------------


def spawn_router(ckpt, **generator_overrides):
    os.environ["OMP_NUM_THREADS"] = "1"  # replica procs inherit the controller's environment
    config = GeneratorConfig(replicas=2, max_num_seqs=32, max_num_tokens=512, kv_cache_tokens=4096,
                             max_model_len=512, restart_dead=False, **generator_overrides)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    return procs, procs.spawn("router", GeneratorRouter, config, ModelConfig(path=str(ckpt)))


def test_router_serves_concurrent_requests_sticky_sessions_and_weight_updates(tiny_ckpt):
    model = from_pretrained(tiny_ckpt, dtype="float32")

    async def main():
        procs, router = spawn_router(tiny_ckpt)
        requests = prompts(64, 1, 80, seed=3)
        max_tokens = [4 + (7 * i) % 21 for i in range(64)]  # 4..24 new tokens
        calls = [router.generate.call_one(p, SamplingParams(max_tokens=m, temperature=1.0, seed=i), f"r{i}")
                 for i, (p, m) in enumerate(zip(requests, max_tokens))]
        completions = await asyncio.gather(*calls)
        assert [c.request_id for c in completions] == [f"r{i}" for i in range(64)]
        assert {c.replica for c in completions} == {0, 1}
        worst = 0.0
        for c, p, m in zip(completions, requests, max_tokens):
            assert c.prompt_token_ids == p and len(c.token_ids) == m and c.versions == [0] * m
            assert c.finish_reason == "length" and min(c.timings.values()) >= 0 and c.timings["prefill_s"] > 0
            ref = reference_logprobs(model, p, c.token_ids)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
        assert worst < 1e-4

        # Sticky sessions: every turn of a session lands where its first turn did, while other
        # traffic keeps both replicas busy.
        async def conversation(session: int) -> set[int]:
            history, replicas = prompts(1, 8, 20, seed=100 + session)[0], set()
            for turn in range(3):
                c = await router.generate.call_one(history, SamplingParams(max_tokens=6, seed=turn),
                                                   f"s{session}t{turn}", f"session-{session}")
                replicas.add(c.replica)
                history = history + c.token_ids + [10 + turn]
            return replicas

        # Two long background requests: with the 6 sessions' turns, at most 8 calls are in flight
        # on a replica, within the router's sticky slack (8), so no session ever has cause to move
        # however the two replica procs get scheduled.
        background = [router.generate.call_one(p, SamplingParams(max_tokens=40), f"bg{i}")
                      for i, p in enumerate(prompts(2, seed=4))]
        sessions = await asyncio.gather(*(conversation(s) for s in range(6)), *background)
        assert all(len(replicas) == 1 for replicas in sessions[:6])
        assert set().union(*sessions[:6]) == {0, 1}

        # Bad input: a clear error for that request only.
        bad = await asyncio.gather(router.generate.call_one([], SamplingParams(), "empty"),
                                   router.generate.call_one([5], {"max_tokens": 0}, "zero"),
                                   router.generate.call_one([5], {"max_tokens": "3"}, "typed"),
                                   router.generate.call_one([5], SamplingParams(max_tokens=3), "fine"),
                                   return_exceptions=True)
        assert isinstance(bad[0], ActorError) and "prompt_token_ids is empty" in str(bad[0])
        assert isinstance(bad[1], ActorError) and "max_tokens must be >= 1" in str(bad[1])
        assert isinstance(bad[2], ActorError) and "malformed request" in str(bad[2])
        assert len(bad[3].token_ids) == 3  # and no replica was blamed (dead == 0 below)

        # Weights: a corrupted sync is rejected by both replicas; a good one changes the outputs.
        probe = [requests[0], SamplingParams(max_tokens=12, temperature=0.0), "probe"]
        before = await router.generate.call_one(*probe)
        new = perturbed(model.state_dict(), seed=7)
        with pytest.raises(ActorError, match="rejected by replica 0: ChecksumMismatch.*replica 1: ChecksumMismatch"):
            await router.update_weights.call_one(1, new, "0" * 32)
        result = await router.update_weights.call_one(1, new, state_checksum(new))
        assert sorted(result["replicas"]) == [0, 1]
        after = [await router.generate.call_one(*probe[:2], f"probe{i}") for i in range(2)]
        model.load_state_dict(new, strict=False)
        for c in after:
            assert c.versions == [1] * 12 and c.token_ids != before.token_ids
            ref = reference_logprobs(model, c.prompt_token_ids, c.token_ids)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-4

        # A replica that answered no probe loads version 1 when its idle loop wakes for it: waited
        # for, so a busy machine cannot make the stats call come first.
        stats = await stats_when(router, lambda s: all(r["engine"]["version"] == 1 for r in s["replicas"]), timeout=30)
        assert stats["states"]["serving"] == 2 and stats["states"]["dead"] == 0 and stats["retries"] == 0
        assert sum(r["completed"] for r in stats["replicas"]) == 64 + 18 + 2 + 1 + 3
        assert all(r["engine"]["version"] == 1 and r["engine"]["healthy"] for r in stats["replicas"])
        assert sum(r["engine"]["prefix_hit_tokens"] for r in stats["replicas"]) > 0  # sticky turns reuse KV
        await router.close.call_one()
        await procs.stop()

    asyncio.run(main())
