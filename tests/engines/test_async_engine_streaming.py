"""AsyncEngine's streamed requests: each step's new tokens reach `on_tokens` while the request
runs, as a prefix of its completion; a callback that raises stops only its own stream."""

from __future__ import annotations

import asyncio

from rlactors.config import GeneratorConfig
from rlactors.engines.async_engine import AsyncEngine
from rlactors.engines.native import NativeEngine
from rlactors.models.checkpoint import from_pretrained
from rlactors.types import SamplingParams


def test_streamed_tokens_come_per_step_and_a_failing_listener_stops_only_its_stream(tiny_ckpt):
    async def main():
        model = from_pretrained(tiny_ckpt, dtype="float32")
        engine = AsyncEngine(NativeEngine(model, GeneratorConfig(max_num_seqs=8, max_num_tokens=256,
                                                                 kv_cache_tokens=2048, max_model_len=512)))
        deltas, broken_calls = [], []

        def broken(delta):
            broken_calls.append(delta)
            raise RuntimeError("the listener broke")

        try:
            sampling = SamplingParams(max_tokens=24, seed=1)
            streamed, other = await asyncio.gather(engine.generate([5, 6, 7], sampling, "streamed", deltas.append),
                                                   engine.generate([8, 9], sampling, "broken", broken))
            assert engine.healthy
        finally:
            await engine.close()
        assert len(deltas) == 23 and [d.start for d in deltas] == list(range(23))  # the last comes with the completion
        assert [t for d in deltas for t in d.token_ids] == streamed.token_ids[:23]
        assert [lp for d in deltas for lp in d.logprobs] == streamed.logprobs[:23]
        assert len(broken_calls) == 1 and len(other.token_ids) == 24 and other.finish_reason == "length"

    asyncio.run(main())
