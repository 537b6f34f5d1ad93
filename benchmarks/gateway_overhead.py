"""Agents through the gateway vs the same conversations sent to the router directly, same run.

One GeneratorRouter with native replicas (CPU) on the tiny alphabet_sort policy (it ends its
turns). The workload: `--sessions` concurrent chat rollouts of `--turns` turns (a question, then
"Continue." after every reply; a turn cut by `--max-tokens` ends its rollout), seeded sampling.
It runs three ways, interleaved, `--repeats` times each, on the same router, with the same
sampled tokens (checked):

- direct: a MessageEnv plays the conversation; the Rollouter sends token ids to the router.
- gateway (HTTP): an AgentEnv plays it by posting the JSON itself (aiohttp): the gateway's own
  cost, every turn an HTTP request (JSON, rendering, tool-call parsing, decoding) that asks the router.
- gateway (openai): the same with the `openai` client, whose request building and response
  parsing are a harness's cost on top (the client runs in the same process, as AgentEnv's does).

Reported: generated tokens/s of the whole batch (best run) and the per-turn latency (p50/p99 over
every turn of every run) seen by the caller of a turn (the Rollouter, or the harness). A dated,
commit-stamped row is appended to benchmarks/results/gateway_overhead.md.

    python benchmarks/gateway_overhead.py                 # 64 sessions x 3 turns x 64 tokens, 2 replicas
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

WARM_CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "alphabet_sort" / "warm_checkpoint"
RESULTS = Path(__file__).resolve().parent / "results" / "gateway_overhead.md"
MODES = ("direct", "gateway (HTTP)", "gateway (openai)")
HEADER = """# Gateway overhead: agents through the gateway vs direct router calls

Each row: one `python benchmarks/gateway_overhead.py` run (its docstring says what is measured).
Throughput is generated tokens/s of the whole batch of sessions (best of the repeats); latency is
per turn, as the turn's caller sees it, over all repeats. Goal: gateway >= 0.9x direct on CPU.
"HTTP" posts the JSON with aiohttp (the gateway's own cost); "openai" uses the `openai` client.

| date (UTC) | commit | machine | command | sessions x turns x max tokens | direct tok/s \
| gateway (HTTP) tok/s | gateway (openai) tok/s | HTTP / direct | openai / direct \
| direct turn p50 / p99 s | HTTP turn p50 / p99 s | openai turn p50 / p99 s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


@dataclass
class ChatConfig:
    turns: int = 3


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_envs(tokenizer, latencies: dict[str, list[float]]):
    from rlactors.gateway import AgentEnv
    from rlactors.rollout import MessageEnv, MessageStep

    def question(sample):
        return [{"role": "user", "content": f"Tell me a story about the number {sample['id']}."}]

    class ChatEnv(MessageEnv):
        Config = ChatConfig

        async def start(self, sample):
            self.turn = 0
            return question(sample)

        async def respond(self, reply, completion):
            self.turn += 1
            if self.turn == self.config.turns:
                return MessageStep(None, 0.0, done=True)
            return MessageStep([{"role": "user", "content": "Continue."}])

    class ChatAgent(AgentEnv):
        Config = ChatConfig
        mode = "openai"

        async def run(self, sample, client):
            messages = question(sample)
            for turn in range(self.config.turns):
                start = time.perf_counter()
                if self.mode == "openai":
                    response = await client.chat.completions.create(model="policy", messages=messages)
                    message, finish = response.choices[0].message.model_dump(exclude_none=True), \
                        response.choices[0].finish_reason
                else:
                    async with http.post(f"{self.base_url}/chat/completions",
                                         json={"model": "policy", "messages": messages},
                                         headers={"Authorization": f"Bearer {self.api_key}"}) as r:
                        choice = (await r.json())["choices"][0]
                    message, finish = choice["message"], choice["finish_reason"]
                latencies[f"gateway ({self.mode})"].append(time.perf_counter() - start)
                messages.append(message)
                if finish == "length":
                    break  # as a TokenEnv rollout ends at a turn cut by its limit: the same workload
                if turn + 1 < self.config.turns:
                    messages.append({"role": "user", "content": "Continue."})
            return 0.0

    class HttpChatAgent(ChatAgent):
        mode = "HTTP"

    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    envs = {"direct": ChatEnv(ChatConfig(), tokenizer), "gateway (HTTP)": HttpChatAgent(ChatConfig(), tokenizer),
            "gateway (openai)": ChatAgent(ChatConfig(), tokenizer)}
    return envs, http


async def benchmark(args, ckpt: Path) -> dict[str, object]:
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter
    from rlactors.config import GatewayConfig, GeneratorConfig, ModelConfig, RolloutConfig
    from rlactors.gateway import Gateway
    from rlactors.models import load_tokenizer
    from rlactors.rollout import Rollouter

    procs = this_host().spawn_procs(per_host={"procs": 1})
    generator = GeneratorConfig(replicas=args.replicas, max_num_seqs=args.sessions, max_num_tokens=2048,
                                kv_cache_tokens=65536, max_model_len=1024, restart_dead=False)
    router = procs.spawn("router", GeneratorRouter, generator, ModelConfig(path=str(ckpt)))
    tokenizer = load_tokenizer(ckpt)
    rollout = RolloutConfig(group_size=args.sessions, prompts_per_step=1, max_turns=args.turns,
                            max_tokens_per_turn=args.max_tokens, max_total_tokens=1024,
                            keep_zero_variance_groups=True, step_timeout_s=600.0)
    gateway = Gateway(GatewayConfig(), tokenizer, rollout.max_tokens_per_turn)
    await gateway.start()
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}

    async def generate(prompt, sampling, request_id, session_id=None):
        return await router.generate.call_one(prompt, sampling, request_id, session_id)

    async def timed_generate(prompt, sampling, request_id, session_id=None):
        start = time.perf_counter()
        completion = await generate(prompt, sampling, request_id, session_id)
        latencies["direct"].append(time.perf_counter() - start)
        return completion

    envs, http = make_envs(tokenizer, latencies)
    for env in envs.values():
        env.gateway = gateway
    best = {mode: float("inf") for mode in MODES}
    tokens: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
    try:
        await Rollouter(envs["direct"], generate, rollout).collect([{"id": -1}])  # warm-up: imports, first steps
        for _ in range(args.repeats):
            for mode in MODES:
                start = time.perf_counter()
                batch = await Rollouter(envs[mode], timed_generate if mode == "direct" else generate,
                                        rollout).collect([{"id": 0}])
                seconds = time.perf_counter() - start
                rollouts = batch.groups[0].rollouts
                assert all(r.status.value in ("completed", "truncated_length") for r in rollouts), \
                    [r.error for r in rollouts]
                tokens[mode].append([t for r in rollouts for turn in r.turns for t in turn.token_ids])
                generated = len(tokens[mode][-1])
                best[mode] = min(best[mode], seconds / generated)
                print(f"  {mode}: {generated} tokens in {seconds:.2f} s ({generated / seconds:,.0f} tokens/s)",
                      flush=True)
        same = all(run == tokens["direct"][0] for mode in MODES for run in tokens[mode])
        print(f"every run sampled the same tokens: {same}")
    finally:
        await http.close()
        await gateway.stop()
        await router.close.call_one()
        await procs.stop()
    return {"tokens_per_s": {m: 1 / best[m] for m in best}, "latencies": latencies}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the row without appending it")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # replica procs inherit it: one thread each on a small box
    from rlactors.supervision import use_fast_supervision

    use_fast_supervision()
    result = asyncio.run(benchmark(args, WARM_CHECKPOINT))
    rate, lat = result["tokens_per_s"], result["latencies"]
    p = {m: f"{_percentile(lat[m], 0.5):.3f} / {_percentile(lat[m], 0.99):.3f}" for m in MODES}
    machine = f"{platform.machine()} {os.cpu_count()} cores (shared), CPU"
    command = " ".join(["python benchmarks/gateway_overhead.py", *sys.argv[1:]])
    row = (f"| {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} | {commit()} | {machine} | `{command}` "
           f"| {args.sessions} x {args.turns} x {args.max_tokens} "
           + "".join(f"| {rate[m]:,.0f} " for m in MODES)
           + "".join(f"| **{rate[m] / rate['direct']:.2f}x** " for m in MODES[1:])
           + "".join(f"| {p[m]} " for m in MODES) + "|")
    print(row)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text(HEADER)
        with RESULTS.open("a") as f:
            f.write(row + "\n")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
