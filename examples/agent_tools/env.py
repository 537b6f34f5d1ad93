"""A tool-using agent written as ordinary `openai` client code, trained through the gateway.

The agent answers the math word problems of examples/math/data with a calculator tool: it sends
the question with the tool's spec, runs every tool call the model makes and sends the results
back, until the model answers in text or has used its calls. Nothing in `run` knows about RL: the
same loop runs against any OpenAI-compatible server. The reward is the answer's correctness
(`correct`), plus a little for a well-formed tool call (`tool_call`).
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.config import ConfigError
from rlactors.gateway import AgentEnv
from rlactors.rollout.rewards import answers_match, extract_answer, reference_answer

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "Solve the problem. Use the calculator for arithmetic, then give the final answer as a number."
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or what is wrong with it (the tool's reply either way)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


@dataclass
class AgentToolsConfig:
    train_path: str = "examples/math/data/train.jsonl"
    eval_path: str = "examples/math/data/eval.jsonl"
    max_tool_calls: int = 2  # model calls per problem beyond the first
    tool_call_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.max_tool_calls < 0:
            raise ConfigError(f"env.args.max_tool_calls: must be >= 0, got {self.max_tool_calls}")


class CalculatorAgent(AgentEnv):
    Config = AgentToolsConfig

    def dataset(self, split: str) -> list[dict[str, Any]]:
        path = {"train": self.config.train_path, "eval": self.config.eval_path}[split]
        path = Path(path) if Path(path).is_absolute() or Path(path).exists() else ROOT.parent / path
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [{"question": r["question"], "answer": reference_answer(r["answer"])} for r in rows]

    async def run(self, sample: dict[str, Any], client: Any) -> dict[str, float]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": sample["question"]}]
        tool_calls = 0
        for _ in range(self.config.max_tool_calls + 1):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                tool_calls += 1
                arguments = json.loads(call.function.arguments)
                result = calculate(str(arguments.get("expression", ""))) if call.function.name == "calculator" \
                    else f"error: no tool named {call.function.name!r}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        final = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
        predicted = extract_answer(final)
        correct = predicted is not None and answers_match(predicted, sample["answer"])
        return {"correct": float(correct), "tool_call": self.config.tool_call_weight * float(tool_calls > 0)}
