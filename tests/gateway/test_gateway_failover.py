"""A stream through the gateway whose replica is SIGKILLed mid-reply, with real procs and the real
`openai` client: the reply arrives token by token, the stream goes on (another replica continues
from the tokens sent), and what the client got is exactly the turn the rollout recorded."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from support.router_procs import spawn_router

from rlactors.config import GatewayConfig, RolloutConfig
from rlactors.gateway import AgentEnv, Gateway
from rlactors.models import load_tokenizer
from rlactors.rollout import Rollouter, RolloutStatus
from rlactors.run import generation


@dataclass
class StoryConfig:
    on_first_piece: Callable[[], Awaitable[None]] | None = None
    replies: list = field(default_factory=list)  # (content, logprobs) as the client got them


class StreamedStory(AgentEnv):
    """One streamed turn; the test's `on_first_piece` runs when its first content arrives."""

    Config = StoryConfig

    def __init__(self, config=None, tokenizer=None):
        super().__init__(config, tokenizer)
        self.stop_token_ids = ()  # the random policy's turn runs to max_tokens: long enough to kill mid-way

    async def run(self, sample, client):
        pieces, logprobs = [], []
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Tell me a story."}], stream=True, logprobs=True)
        async for chunk in stream:
            choice = chunk.choices[0]
            logprobs += [lp.logprob for lp in choice.logprobs.content] if choice.logprobs else []
            if choice.delta.content:
                pieces.append(choice.delta.content)
                if len(pieces) == 1:
                    await self.config.on_first_piece()
        self.config.replies.append(("".join(pieces), logprobs, len(pieces)))
        return 0.0


def test_a_replica_killed_mid_stream_leaves_the_client_an_exact_reply(tiny_ckpt):
    async def main():
        procs, router = spawn_router(tiny_ckpt, restart_dead=False)
        tokenizer = load_tokenizer(tiny_ckpt)
        rollout = RolloutConfig(group_size=2, max_turns=1, max_tokens_per_turn=160, max_total_tokens=480,
                                step_timeout_s=60.0, keep_zero_variance_groups=True)
        gateway = Gateway(GatewayConfig(), tokenizer, rollout.max_tokens_per_turn)
        await gateway.start()
        killed = []

        async def kill_the_serving_replica():  # once: the first rollout's replica, say
            if killed:
                return
            killed.append(None)
            stats = await router.stats.call_one()
            replica = next(r for r in stats["replicas"] if r["in_flight"])
            os.kill(replica["engine"]["pid"], signal.SIGKILL)

        async def generate(prompt, sampling, request_id, session_id=None, on_tokens=None):
            return await generation.generate(router, prompt, sampling, request_id, session_id, on_tokens=on_tokens)

        try:
            env = StreamedStory(StoryConfig(on_first_piece=kill_the_serving_replica), tokenizer)
            env.gateway = gateway
            batch = await Rollouter(env, generate, rollout).collect([{}])
            stats = await router.stats.call_one()
        finally:
            await gateway.stop()
            await router.close.call_one()
            await procs.stop()
        assert stats["deaths"] == 1 and stats["retries"] == 1  # one of the two streams failed over
        turns = {tokenizer.decode(r.turns[0].token_ids, skip_special_tokens=True): r.turns[0]
                 for r in batch.groups[0].rollouts}
        assert [r.status for r in batch.groups[0].rollouts] == [RolloutStatus.TRUNCATED_LENGTH] * 2  # 160 tokens
        assert len(env.config.replies) == 2 and len(turns) == 2
        for content, logprobs, pieces in env.config.replies:
            assert len(turns[content].token_ids) == 160 and logprobs == turns[content].logprobs
            assert pieces > 10  # piece by piece as sampled: deltas that all came with the completion make one piece

    asyncio.run(main())
