"""Generator-side faults with real Monarch procs on CPU: a replica proc SIGKILLed while it serves
and while new weights arrive, corrupted weights on their way to the replicas, and 2,000
concurrent requests through the router."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import monarch.config
import pytest
import torch
from faultkit import rss_mb
from monarch.actor import this_host
from support.router_procs import stats_when

from rlactors.actors.router import GeneratorRouter
from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.models.checkpoint import from_pretrained
from rlactors.types import SamplingParams
from rlactors.weight_sync.checksum import state_checksum

VOCAB = 1024


def prompts(n: int, seed: int, low: int = 4, high: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def perturbed_weights(ckpt, seed: int) -> dict[str, torch.Tensor]:
    model = from_pretrained(ckpt, dtype="float32")
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
            if k != "lm_head.weight"}


def spawn_router(ckpt, restart_dead: bool, replicas: int = 2):
    config = GeneratorConfig(replicas=replicas, max_num_seqs=64, max_num_tokens=1024, kv_cache_tokens=8192,
                             max_model_len=256, restart_dead=restart_dead)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    return procs, procs.spawn("router", GeneratorRouter, config, ModelConfig(path=str(ckpt)))


def test_replica_killed_mid_rollout_is_detected_in_2s_and_restarted_at_the_newest_weights(tiny_ckpt, fault_record):
    """Requests keep flowing while replica 1 is SIGKILLed and a new version is pushed during its
    restart: every request completes, and the restarted replica serves only the newest weights."""
    v3, v4 = perturbed_weights(tiny_ckpt, seed=3), perturbed_weights(tiny_ckpt, seed=4)

    async def main():
        procs, router = spawn_router(tiny_ckpt, restart_dead=True)
        await router.update_weights.call_one(3, v3, state_checksum(v3))
        stop_load = asyncio.Event()
        completions = []

        async def load(worker: int) -> None:
            for i in range(10_000):
                if stop_load.is_set():
                    return
                batch = prompts(4, seed=1000 * worker + i)
                calls = [router.generate.call_one(p, SamplingParams(max_tokens=24, seed=j), f"w{worker}/{i}/{j}")
                         for j, p in enumerate(batch)]
                completions.extend(await asyncio.gather(*calls))

        workers = [asyncio.ensure_future(load(w)) for w in range(4)]
        stats = await stats_when(router, lambda s: s["replicas"][1]["in_flight"] > 0
                                 and s["replicas"][1]["engine"]["generated_tokens"] > 0, timeout=60, interval=0.02)
        old_pid = stats["replicas"][1]["engine"]["pid"]
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await stats_when(router, lambda s: s["replicas"][1]["state"] != "serving", timeout=30, interval=0.02)
        detection_s = time.monotonic() - killed_at
        # A new policy arrives while replica 1 restarts: it must come up at this one, not at v3.
        pushed = await router.update_weights.call_one(4, v4, state_checksum(v4))
        assert pushed["replicas"] == [0]
        stats = await stats_when(router, lambda s: s["restarts"] == 1 and s["states"]["serving"] == 2,
                                 timeout=90, interval=0.1)
        restart_s = time.monotonic() - killed_at
        restarted = stats["replicas"][1]
        assert restarted["engine"]["pid"] != old_pid and restarted["version"] == 4
        # The restarted replica serves (load still flowing), then the load stops. Its engine loads
        # v4 at its next step boundary and admits no request before then.
        answered = await stats_when(router, lambda s: s["replicas"][1]["completed"] > 0, timeout=30, interval=0.1)
        assert answered["replicas"][1]["engine"]["version"] == 4
        stop_load.set()
        await asyncio.gather(*workers)

        sent = {c.request_id for c in completions}
        assert len(sent) == len(completions) and len(completions) >= 8
        assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in completions)
        assert all(set(c.versions) <= {3, 4} for c in completions)
        served_by_new = [c for c in completions if c.replica == 1 and 4 in c.versions]
        assert served_by_new and all(set(c.versions) == {4} for c in served_by_new)
        final = await router.stats.call_one()
        assert final["deaths"] == 1 and final["states"]["dead"] == 0 and final["retries"] >= 1
        after = await asyncio.gather(*(router.generate.call_one(p, SamplingParams(max_tokens=2), f"a{i}")
                                       for i, p in enumerate(prompts(12, seed=7))))
        assert {c.replica for c in after} == {0, 1} and all(set(c.versions) == {4} for c in after)
        await router.close.call_one()
        await procs.stop()
        return detection_s, restart_s, len(completions), final["retries"]

    detection_s, restart_s, served, retries = asyncio.run(main())
    assert detection_s < 2.0, f"replica death noticed after {detection_s:.2f} s"
    fault_record("generator replica proc killed mid-rollout",
                 "SIGKILL of replica 1's proc under load (4 clients, 4 requests each in flight), then "
                 "policy v4 pushed while it restarts", detection_s,
                 f"nothing: {served}/{served} requests completed ({retries} retried on replica 0)",
                 restart_s=restart_s)


@pytest.fixture(scope="module")
def router(tiny_ckpt):
    """Two healthy replicas, shared by the tests below (each leaves it healthy)."""
    procs, router = spawn_router(tiny_ckpt, restart_dead=False)
    yield router

    async def close():
        await router.close.call_one()
        await procs.stop()

    asyncio.run(close())


def flip_one_bit(weights: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    corrupted = dict(weights)
    tensor = weights[name].clone()
    tensor.view(-1).view(torch.int32)[tensor.numel() // 2] ^= 1 << 12  # one mantissa bit of one value
    corrupted[name] = tensor
    return corrupted


def swap_two(weights: dict[str, torch.Tensor], a: str, b: str) -> dict[str, torch.Tensor]:
    corrupted = dict(weights)
    corrupted[a], corrupted[b] = weights[b], weights[a]
    return corrupted


def test_corrupted_weights_are_rejected_by_checksum_and_never_served(tiny_ckpt, router, fault_record):
    good = perturbed_weights(tiny_ckpt, seed=11)
    checksum = state_checksum(good)
    corruptions = {
        "one bit flipped in model.layers.1.mlp.down_proj.weight":
            flip_one_bit(good, "model.layers.1.mlp.down_proj.weight"),
        "layer 0 and layer 1 q_norm swapped": swap_two(good, "model.layers.0.self_attn.q_norm.weight",
                                                       "model.layers.1.self_attn.q_norm.weight"),
    }
    probe = prompts(1, seed=5)[0]
    greedy = SamplingParams(max_tokens=12, temperature=1.0, top_k=1)

    async def main():
        before = await router.generate.call_one(probe, greedy, "probe-before")
        version = (await router.stats.call_one())["replicas"][0]["version"]
        detection = {}
        for what, corrupted in corruptions.items():
            start = time.monotonic()
            with pytest.raises(Exception, match="ChecksumMismatch") as raised:
                await router.update_weights.call_one(version + 1, corrupted, checksum)
            detection[what] = time.monotonic() - start
            message = str(raised.value)
            assert f"weights version {version + 1} rejected by replica 0" in message and "replica 1" in message
            stats = await router.stats.call_one()
            assert stats["states"]["serving"] == 2 and [r["version"] for r in stats["replicas"]] == [version, version]
            again = await router.generate.call_one(probe, greedy, f"probe-after-{len(detection)}")
            assert again.token_ids == before.token_ids and set(again.versions) == {version}
        # The intact weights with the same checksum are accepted and served.
        await router.update_weights.call_one(version + 1, good, checksum)
        fresh = await router.generate.call_one(probe, greedy, "probe-good")
        assert set(fresh.versions) == {version + 1}
        return detection

    detection = asyncio.run(main())
    for what, seconds in detection.items():
        fault_record("weight-sync corruption", f"{what}, sent with the intact weights' checksum to 2 replicas",
                     seconds, "nothing: both replicas kept serving the previous version, bitwise the same "
                     "greedy output; the intact weights then loaded")


def test_2000_concurrent_requests_complete_with_bounded_memory(router, fault_record):
    n = 2000
    batch = prompts(n, seed=21, low=2, high=12)

    async def main():
        stats = await router.stats.call_one()
        pids = [r["engine"]["pid"] for r in stats["replicas"]]
        rss_before = [rss_mb(p) for p in pids]
        start = time.monotonic()
        completions = await asyncio.gather(*(
            router.generate.call_one(p, SamplingParams(max_tokens=4, seed=i), f"load{i}") for i, p in enumerate(batch)))
        elapsed = time.monotonic() - start
        rss_after = [rss_mb(p) for p in pids]
        return completions, elapsed, rss_before, rss_after, await router.stats.call_one()

    # 2000 calls at once starve the 2-core box for seconds: a state query of the router's proc can
    # then go unanswered for longer than the 1 s that counts a killed proc dead in the other tests.
    # With 10 s this failed twice in about 15 suite passes on 2026-11-23 ("timeout waiting for
    # message from proc mesh agent while querying for router"), so the load runs with 30 s.
    with monarch.config.configured(get_actor_state_max_idle="30s"):
        completions, elapsed, rss_before, rss_after, stats = asyncio.run(main())
    assert [c.request_id for c in completions] == [f"load{i}" for i in range(n)]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 4 and len(c.logprobs) == 4 for c in completions)
    assert all(list(c.prompt_token_ids) == p for c, p in zip(completions, batch))
    # Nothing held after the burst: no request in flight, every KV-cache block free again.
    for replica in stats["replicas"]:
        engine = replica["engine"]
        assert replica["in_flight"] == 0 and engine["in_flight"] == 0
        assert engine["free_blocks"] == engine["total_blocks"] and engine["waiting"] == engine["running"] == 0
    assert sum(r["completed"] for r in stats["replicas"]) >= n and stats["retries"] == 0
    growth = [after - before for before, after in zip(rss_before, rss_after)]
    assert max(growth) < 64, f"replica RSS grew by {growth} MB over {n} requests"
    fault_record("load", f"{n} concurrent generate calls (2-12 prompt tokens, 4 new tokens) through the router "
                 "to 2 replicas", None, f"nothing: {n}/{n} completed",
                 wall_s=elapsed, requests_per_second=n / elapsed, max_replica_rss_growth_mb=max(growth))


def test_killed_replica_without_restart_leaves_the_run_degraded(router, fault_record):
    """generator.restart_dead = false: the survivor serves everything, the dead replica stays dead.
    (Last in this module: it leaves the shared router with one replica.)"""
    batch = prompts(40, seed=31)

    async def main():
        stats = await router.stats.call_one()
        assert stats["states"]["serving"] == 2
        calls = [asyncio.ensure_future(router.generate.call_one(p, SamplingParams(max_tokens=24, seed=i), f"d{i}"))
                 for i, p in enumerate(batch)]
        stats = await stats_when(router, lambda s: s["replicas"][0]["in_flight"] > 0
                                 and s["replicas"][0]["engine"]["generated_tokens"] > 0, timeout=60, interval=0.02)
        killed_at = time.monotonic()
        os.kill(stats["replicas"][0]["engine"]["pid"], signal.SIGKILL)
        await stats_when(router, lambda s: s["replicas"][0]["state"] != "serving", timeout=30, interval=0.02)
        detection_s = time.monotonic() - killed_at
        completions = await asyncio.gather(*calls)
        await asyncio.sleep(1.0)  # a restart, were one (wrongly) started, would show in the stats
        return detection_s, completions, await router.stats.call_one()

    detection_s, completions, stats = asyncio.run(main())
    assert [c.request_id for c in completions] == [f"d{i}" for i in range(40)]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in completions)
    assert stats["states"]["serving"] == 1 and stats["states"]["dead"] == 1
    assert stats["restarts"] == 0 and stats["restarting"] == []
    assert detection_s < 2.0, f"replica death noticed after {detection_s:.2f} s"
    fault_record("generator replica proc killed, no restart (restart_dead = false)",
                 "SIGKILL of replica 0's proc with 40 requests in flight", detection_s,
                 "nothing: 40/40 requests completed, on replica 1; the run goes on with 1 of 2 replicas")
