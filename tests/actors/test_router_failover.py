"""Failover with real process deaths: a Generator replica's proc is SIGKILLed mid-flight; every
request still completes on a live replica, the router reports the death, and (when configured)
restarts the replica at the latest weights before it takes requests."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from monarch.actor import ActorError
from support.router_procs import spawn_router, stats_when

from rlactors.models.checkpoint import from_pretrained
from rlactors.types import SamplingParams
from rlactors.weight_sync.checksum import state_checksum

VOCAB = 1024


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


def test_killed_replica_loses_no_request_and_is_reported_dead(tiny_ckpt):
    async def main():
        procs, router = spawn_router(tiny_ckpt, restart_dead=False)
        batch = prompts(40, seed=0)
        calls = [asyncio.ensure_future(router.generate.call_one(p, SamplingParams(max_tokens=120, seed=i), f"r{i}"))
                 for i, p in enumerate(batch)]
        stats = await stats_when(router, lambda s: s["replicas"][0]["in_flight"] > 0
                                 and s["replicas"][0]["engine"]["generated_tokens"] > 0)
        os.kill(stats["replicas"][0]["engine"]["pid"], signal.SIGKILL)
        completions = await asyncio.gather(*calls)
        assert [c.request_id for c in completions] == [f"r{i}" for i in range(40)]
        assert all(len(c.token_ids) == 120 and c.finish_reason == "length" for c in completions)
        stats = await router.stats.call_one()
        assert stats["states"]["dead"] == 1 and stats["states"]["serving"] == 1 and stats["deaths"] == 1
        assert stats["replicas"][0]["state"] != "serving" and stats["replicas"][1]["state"] == "serving"
        assert await router.dead_replicas.call_one() == [0]
        assert stats["replicas"][0]["completed"] + stats["replicas"][1]["completed"] == 40
        assert stats["retries"] >= 1  # the requests that were in flight on replica 0
        assert sum(c.replica == 1 for c in completions) == stats["replicas"][1]["completed"]
        # The survivor keeps serving; the dead replica gets nothing.
        more = await asyncio.gather(*(router.generate.call_one(p, SamplingParams(max_tokens=4), f"m{i}")
                                      for i, p in enumerate(prompts(8, seed=1))))
        assert {c.replica for c in more} == {1}
        # With no replica left, a request fails with a clear error instead of hanging.
        os.kill(stats["replicas"][1]["engine"]["pid"], signal.SIGKILL)
        with pytest.raises(ActorError, match="no live generator replica"):
            await router.generate.call_one(batch[0], SamplingParams(max_tokens=4), "orphan")
        stats = await router.stats.call_one()
        assert stats["states"]["dead"] == 2 and stats["deaths"] == 2 and await router.dead_replicas.call_one() == [0, 1]
        await router.close.call_one()
        await procs.stop()

    asyncio.run(main())


def test_replicas_that_cannot_start_are_reported_and_requests_fail_clearly(tmp_path):
    async def main():
        procs, router = spawn_router(tmp_path / "no_checkpoint_here", restart_dead=True, replicas=1)
        with pytest.raises(ActorError, match="no live generator replica"):
            await router.generate.call_one([5, 6], SamplingParams(max_tokens=4), "r")
        stats = await router.stats.call_one()
        # It never served, so one restart was tried, which failed the same way; no crash loop.
        assert stats["states"]["serving"] == 0 and stats["states"]["dead"] == 1 and stats["failed_restarts"] == 1
        assert stats["restarts"] == 0 and stats["restarting"] == []
        await router.close.call_one()
        await procs.stop()

    asyncio.run(main())


def test_dead_replica_restarts_at_the_latest_weights_before_serving(tiny_ckpt):
    model = from_pretrained(tiny_ckpt, dtype="float32")
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
           if k != "lm_head.weight"}

    async def main():
        procs, router = spawn_router(tiny_ckpt, restart_dead=True)
        await router.update_weights.call_one(4, new, state_checksum(new))
        calls = [asyncio.ensure_future(router.generate.call_one(p, SamplingParams(max_tokens=60), f"r{i}"))
                 for i, p in enumerate(prompts(16, seed=2))]
        stats = await stats_when(router, lambda s: s["replicas"][1]["in_flight"] > 0
                                 and s["replicas"][1]["engine"]["generated_tokens"] > 0)
        old_pid = stats["replicas"][1]["engine"]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        completions = await asyncio.gather(*calls)
        assert all(len(c.token_ids) == 60 and set(c.versions) == {4} for c in completions)
        seen = []  # replica 1's states as the restart goes, each new one once

        def restarted(s):
            if not seen or seen[-1] != s["replicas"][1]["state"]:
                seen.append(s["replicas"][1]["state"])
            return s["restarts"] == 1 and s["states"]["serving"] == 2

        stats = await stats_when(router, restarted)
        # The dead replica's slot holds its replacement, which starts, then serves.
        assert seen[-2:] == ["starting", "serving"] and "serving" not in seen[:-1], seen
        restarted = stats["replicas"][1]
        # Verified before it serves; its engine loads the weights at its next step boundary and
        # admits no request before then, so its engine's version is checked once it has answered.
        assert restarted["engine"]["pid"] != old_pid and restarted["version"] == 4
        assert stats["deaths"] == 1 and stats["states"]["dead"] == 0
        after = await asyncio.gather(*(router.generate.call_one(p, SamplingParams(max_tokens=4), f"a{i}")
                                       for i, p in enumerate(prompts(12, seed=3))))
        assert {c.replica for c in after} == {0, 1} and all(set(c.versions) == {4} for c in after)
        assert (await router.stats.call_one())["replicas"][1]["engine"]["version"] == 4  # it answered: loaded
        await router.close.call_one()
        await procs.stop()

    asyncio.run(main())
