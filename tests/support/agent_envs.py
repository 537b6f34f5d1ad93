"""Agents for the gateway tests: the calculator conversation of `support.tool_policy`, played by an
`openai` client loop (AgentEnv) and, for reference, by a MessageEnv that sends the same messages."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from rlactors_examples.agent_tools.env import calculate

from rlactors.gateway import AgentEnv
from rlactors.gateway.tool_calls import parse_tool_calls
from rlactors.rollout import MessageEnv, MessageStep
from support.tool_policy import ANSWER, TOOLS, conversation


@dataclass
class ToolAgentConfig:
    stream: bool = False
    edit_history: bool = False  # drop the system message from the second request on
    fail: str = ""  # "raise" or "hang" after the first turn
    max_calls: int = 3
    # Given a list, each reply as the client got it is appended: (content, tool calls, logprobs, pieces of content)
    replies: list | None = None


class ToolAgent(AgentEnv):
    """The plain `openai` tool-calling loop: call, run the tools, send their results, repeat."""

    Config = ToolAgentConfig

    async def run(self, sample, client):
        messages, turns = conversation(), 0
        while turns < self.config.max_calls:
            if turns == 1 and self.config.edit_history:
                messages = messages[1:]
            message = await self._create(client, messages)
            turns += 1
            if self.config.fail == "raise":
                raise RuntimeError("the harness broke")
            if self.config.fail == "hang":
                await asyncio.sleep(3600)
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                result = calculate(json.loads(call["function"]["arguments"])["expression"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return {"correct": float(messages[-1].get("content") == ANSWER)}

    async def _create(self, client, messages):
        if not self.config.stream:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                            logprobs=True)
            choice = response.choices[0]
            message = choice.message.model_dump(exclude_none=True)
            self._record(message, [(lp.token, lp.logprob) for lp in choice.logprobs.content], [message.get("content")])
            return message
        pieces, calls, logprobs = [], [], []
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                      logprobs=True)
        async for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            if choice is not None:
                pieces += [choice.delta.content] if choice.delta.content else []
                calls += [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                        "arguments": c.function.arguments}}
                          for c in choice.delta.tool_calls or ()]
                logprobs += [(lp.token, lp.logprob) for lp in choice.logprobs.content] if choice.logprobs else []
        message = {"role": "assistant", "content": "".join(pieces) or None, **({"tool_calls": calls} if calls else {})}
        self._record(message, logprobs, pieces)
        return message

    def _record(self, message, logprobs, pieces):
        if self.config.replies is not None:
            calls = [c["function"] for c in message.get("tool_calls", ())]
            self.config.replies.append((message.get("content"), calls, logprobs, pieces))


class ToolMessageEnv(MessageEnv):
    """The same conversation as ToolAgent, as a MessageEnv: the reference for exact tokens."""

    def __init__(self, config=None, tokenizer=None):
        super().__init__(config, tokenizer)
        self.tools = TOOLS

    async def start(self, sample):
        return conversation()

    async def respond(self, reply, completion):
        parsed = parse_tool_calls(reply)
        if not parsed.tool_calls:
            return MessageStep(None, {"correct": float(reply == ANSWER)}, done=True)
        return MessageStep([{"role": "tool", "tool_call_id": c["id"],
                             "content": calculate(json.loads(c["function"]["arguments"])["expression"])}
                            for c in parsed.tool_calls])


class LangChainToolAgent(AgentEnv):
    """ToolAgent's loop written with LangChain's ChatOpenAI, which builds its own client from
    `base_url` and `api_key` and converts messages its own way."""

    async def run(self, sample, client):
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
        from langchain_openai import ChatOpenAI

        system, user = conversation()
        llm = ChatOpenAI(model="policy", base_url=self.base_url, api_key=self.api_key, max_retries=0).bind_tools(TOOLS)
        messages = [SystemMessage(system["content"]), HumanMessage(user["content"])]
        for _ in range(3):
            reply: AIMessage = await llm.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            messages += [ToolMessage(calculate(call["args"]["expression"]), tool_call_id=call["id"])
                         for call in reply.tool_calls]
        return {"correct": float(messages[-1].content == ANSWER)}


class AgentsSdkToolAgent(AgentEnv):
    """ToolAgent's task as an OpenAI Agents SDK agent: `Runner.run` with the SDK's Chat Completions
    model on the session's `openai` client; the SDK runs the calculator tool itself, and sends the
    tool with `strict: false`."""

    async def run(self, sample, client):
        from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, RunConfig, Runner

        async def calculator(context, arguments: str) -> str:
            return calculate(json.loads(arguments)["expression"])

        spec = TOOLS[0]["function"]
        tool = FunctionTool(name=spec["name"], description=spec["description"], params_json_schema=spec["parameters"],
                            on_invoke_tool=calculator, strict_json_schema=False)
        system, user = conversation()
        agent = Agent(name="calculator agent", instructions=system["content"], tools=[tool],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        result = await Runner.run(agent, user["content"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
        return {"correct": float(result.final_output == ANSWER)}
