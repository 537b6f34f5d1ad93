"""Agents through the gateway, end to end on CPU: the real `openai` client (and LangChain, and the OpenAI Agents
SDK), real Monarch procs (GeneratorRouter + a native replica) and a tiny policy that calls a calculator tool."""

from __future__ import annotations

import asyncio
import os

from monarch.actor import this_host
from support.agent_envs import AgentsSdkToolAgent, LangChainToolAgent, ToolAgent, ToolAgentConfig, ToolMessageEnv
from support.tool_policy import ANSWER, CALL

from rlactors.actors.router import GeneratorRouter
from rlactors.config import GatewayConfig, GeneratorConfig, ModelConfig, RolloutConfig
from rlactors.gateway import Gateway
from rlactors.models import load_tokenizer
from rlactors.rollout import Rollouter, RolloutStatus
from rlactors.run import generation

# Near-greedy: the memorised conversation is sampled every time, on any CPU.
ROLLOUT = RolloutConfig(group_size=2, max_turns=3, max_tokens_per_turn=96, max_total_tokens=512, temperature=0.3,
                        step_timeout_s=20.0, keep_zero_variance_groups=True)


async def serving(ckpt, rollout_config=ROLLOUT):
    """A router with one native replica, a started gateway, and a Rollouter factory for an env. The
    replica runs the true on-policy kernels: its logprobs do not depend on the batch or the prefix
    cache, so two runs of one conversation compare bit for bit."""
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = this_host().spawn_procs(per_host={"procs": 1})
    config = GeneratorConfig(replicas=1, max_num_seqs=64, max_num_tokens=1024, kv_cache_tokens=32768,
                             max_model_len=512, restart_dead=False)
    router = procs.spawn("router", GeneratorRouter, config, ModelConfig(path=str(ckpt), true_on_policy=True))
    tokenizer = load_tokenizer(ckpt)
    gateway = Gateway(GatewayConfig(), tokenizer, rollout_config.max_tokens_per_turn)
    await gateway.start()

    async def generate(prompt, sampling, request_id, session_id=None, on_tokens=None):
        return await generation.generate(router, prompt, sampling, request_id, session_id, on_tokens=on_tokens)

    def rollouter(env, config=rollout_config):
        env.gateway = gateway
        return Rollouter(env, generate, config)

    async def close():
        await gateway.stop()
        await router.close.call_one()
        await procs.stop()

    return tokenizer, gateway, rollouter, close


def turns_of(batch):
    return [[(t.prompt_token_ids, t.token_ids, t.logprobs, t.versions, t.finish_reason) for t in r.turns]
            for g in batch.groups for r in g.rollouts]


def test_openai_tool_calling_is_exact_streams_the_same_and_branches_on_edits(tool_policy_ckpt):
    async def main():
        tokenizer, gateway, rollouter, close = await serving(tool_policy_ckpt)
        try:
            sample = [{"id": 0}]
            replies, streamed_replies = [], []
            agent = await rollouter(ToolAgent(ToolAgentConfig(replies=replies), tokenizer)).collect(sample)
            reference = await rollouter(ToolMessageEnv(None, tokenizer)).collect(sample)
            streamed = await rollouter(ToolAgent(ToolAgentConfig(stream=True, replies=streamed_replies),
                                                 tokenizer)).collect(sample)
            edited = await rollouter(ToolAgent(ToolAgentConfig(edit_history=True), tokenizer)).collect(sample)
            langchain = await rollouter(LangChainToolAgent(None, tokenizer)).collect(sample)
            agents_sdk = await rollouter(AgentsSdkToolAgent(None, tokenizer)).collect(sample)
        finally:
            await close()

        # Multi-turn tool calling: the model called the calculator, got 391 back, and answered.
        for rollout in agent.groups[0].rollouts:
            assert rollout.status is RolloutStatus.COMPLETED and rollout.reward == 1.0, rollout.error
            calls, answer = rollout.turns
            assert tokenizer.decode(calls.token_ids, skip_special_tokens=True) == CALL
            assert tokenizer.decode(answer.token_ids, skip_special_tokens=True) == ANSWER
            assert "<tool_response>\n391\n</tool_response>" in tokenizer.decode(answer.prompt_token_ids)
        # Bit for bit the MessageEnv's conversation: prompts, sampled tokens, logprobs, versions;
        # and one episode per rollout whose trained tokens are exactly the sampled ones.
        assert turns_of(agent) == turns_of(reference)
        assert [(e.token_ids, e.loss_mask, e.generator_logprobs) for e in agent.episodes] == \
            [(e.token_ids, e.loss_mask, e.generator_logprobs) for e in reference.episodes]
        for episode, rollout in zip(agent.episodes, agent.groups[0].rollouts):
            sampled = [tok for t in rollout.turns for tok in t.token_ids]
            assert [tok for tok, m in zip(episode.token_ids, episode.loss_mask) if m] == sampled
        assert agent.metrics["rollout/branch_episodes"] == 0 and len(agent.episodes) == 2
        # Streaming samples the same tokens, and the client gets the same text, tool calls and logprobs:
        # the answer token by token, the tool call never as content.
        assert turns_of(streamed) == turns_of(agent) and streamed.metrics["rollout/reward_mean"] == 1.0
        assert sorted((r[:3] for r in streamed_replies), key=repr) == sorted((r[:3] for r in replies), key=repr)
        assert len(replies) == 4
        for content, calls, logprobs, pieces in streamed_replies:
            assert (content, pieces) == (None, []) if calls else len(pieces) > 3 and "".join(pieces) == ANSWER
            assert len(logprobs) == len(tokenizer.encode(CALL if calls else ANSWER, add_special_tokens=False)) + 1
        # LangChain's ChatOpenAI, with its own client and message conversion: the same tokens, no branch.
        assert turns_of(langchain) == turns_of(agent) and langchain.metrics["rollout/reward_mean"] == 1.0
        assert langchain.metrics["rollout/branch_episodes"] == 0
        # The OpenAI Agents SDK's Runner and Chat Completions model: the tool round trip, the same tokens.
        assert turns_of(agents_sdk) == turns_of(agent) and agents_sdk.metrics["rollout/reward_mean"] == 1.0
        assert agents_sdk.metrics["rollout/branch_episodes"] == 0
        # A harness that edits its history (drops the system message) starts a new branch.
        assert edited.metrics["rollout/branch_episodes"] == 2 and len(edited.episodes) == 4
        for rollout in edited.groups[0].rollouts:
            assert rollout.status is RolloutStatus.COMPLETED
            second = rollout.turns[1].prompt_token_ids
            assert not tokenizer.decode(second).startswith("<|im_start|>system\nYou are a careful")
        assert gateway.counters["branches"] == 2 and gateway.counters["unparsable_tool_calls"] == 0

    asyncio.run(main())


def test_64_concurrent_sessions_and_harness_failures_end_only_their_rollout(tool_policy_ckpt):
    async def main():
        tokenizer, gateway, rollouter, close = await serving(tool_policy_ckpt)
        try:
            many = await rollouter(ToolAgent(ToolAgentConfig(), tokenizer), RolloutConfig(
                **{**ROLLOUT.__dict__, "group_size": 8})).collect([{"id": i} for i in range(8)])
            quick = RolloutConfig(**{**ROLLOUT.__dict__, "step_timeout_s": 1.0})
            raised = await rollouter(ToolAgent(ToolAgentConfig(fail="raise"), tokenizer)).collect([{}])
            hung = await rollouter(ToolAgent(ToolAgentConfig(fail="hang"), tokenizer), quick).collect([{}])
            one_turn = RolloutConfig(**{**ROLLOUT.__dict__, "max_turns": 1})
            limited = await rollouter(ToolAgent(ToolAgentConfig(), tokenizer), one_turn).collect([{}])
        finally:
            await close()
        rollouts = [r for g in many.groups for r in g.rollouts]
        assert len(rollouts) == 64 and many.metrics["rollout/status/completed"] == 64
        assert all(len(r.turns) == 2 and r.reward == 1.0 for r in rollouts)
        assert len({r.session_id for r in rollouts}) == 64 and gateway._sessions == {}
        for rollout in raised.groups[0].rollouts:
            assert rollout.status is RolloutStatus.ERROR_ENV and len(rollout.turns) == 1
            assert "RuntimeError: the harness broke" in rollout.error and "agent_envs.py" in rollout.error_traceback
        for rollout in hung.groups[0].rollouts:
            assert rollout.status is RolloutStatus.ERROR_TIMEOUT and "step_timeout_s=1.0" in rollout.error
        for rollout in limited.groups[0].rollouts:  # the second call got a 400; the rollout ends truncated
            assert rollout.status is RolloutStatus.TRUNCATED_TURNS and len(rollout.turns) == 1

    asyncio.run(main())
