"""Streamed generation through the router with real procs: the tokens arrive while the request
runs, are exactly the completion's (those of the same request unstreamed), and stay valid when
the replica is SIGKILLed mid-stream (another replica continues from them)."""

from __future__ import annotations

import asyncio
import os
import signal

from support.router_procs import prompts, spawn_router, wait_for

from rlactors.generation import generate
from rlactors.types import SamplingParams


def test_streamed_tokens_are_the_completion_and_survive_a_replica_killed_mid_stream(tiny_ckpt):
    async def main():
        procs, router = spawn_router(tiny_ckpt, restart_dead=False, true_on_policy=True)
        try:
            prompt = prompts(1, seed=3)[0]
            sampling = SamplingParams(max_tokens=48, temperature=1.0, seed=7)
            deltas, seen_while_running = [], []

            async def on_tokens(delta):
                deltas.append(delta)
                seen_while_running.append(not call.done())

            plain = await generate(router, prompt, sampling, "plain", "s")
            call = asyncio.ensure_future(generate(router, prompt, sampling, "streamed", "s", on_tokens=on_tokens))
            streamed = await call
            assert (streamed.token_ids, streamed.logprobs, streamed.versions, streamed.finish_reason) == \
                (plain.token_ids, plain.logprobs, plain.versions, plain.finish_reason)
            assert [d.start for d in deltas] == [sum(len(e.token_ids) for e in deltas[:i]) for i in range(len(deltas))]
            assert [t for d in deltas for t in d.token_ids] == streamed.token_ids
            assert [lp for d in deltas for lp in d.logprobs] == streamed.logprobs
            assert len(deltas) > 8 and all(seen_while_running)  # token by token, not at the end

            # Kill the serving replica once a few tokens are out: the stream goes on elsewhere.
            deltas.clear()
            long = SamplingParams(max_tokens=200, temperature=1.0, seed=8)
            call = asyncio.ensure_future(generate(router, prompt, long, "killed", "k", on_tokens=on_tokens))
            stats = await wait_for(router, lambda s: any(r["in_flight"] for r in s["replicas"]) and deltas)
            serving = next(r for r in stats["replicas"] if r["in_flight"])
            os.kill(serving["engine"]["pid"], signal.SIGKILL)
            before = len(deltas)
            completion = await call
            stats = await router.stats.call_one()
            assert stats["retries"] == 1 and stats["deaths"] == 1
            assert completion.replica != serving["index"] and before < len(deltas)
            assert [t for d in deltas for t in d.token_ids] == completion.token_ids
            assert [v for d in deltas for v in d.versions] == completion.versions
            assert len(completion.token_ids) == 200 and completion.finish_reason == "length"
            assert len(completion.logprobs) == 200 and completion.prompt_token_ids == prompt
        finally:
            await router.close.call_one()
            await procs.stop()

    asyncio.run(main())
