"""Agents through the gateway vs the same conversations sent to the router directly, same run.

One GeneratorRouter with native replicas (CPU) on the tiny alphabet_sort policy (it ends its
turns). The workload: `--sessions` concurrent chat rollouts of `--turns` turns (a question, then
"Continue." after every reply; a turn cut by `--max-tokens` ends its rollout), seeded sampling.
It runs three ways on the same router, with the same sampled tokens (checked):

- direct: a MessageEnv plays the conversation; the Rollouter sends token ids to the router.
- gateway (HTTP): an AgentEnv plays it by posting the JSON itself (aiohttp): the gateway's own
  cost, every turn an HTTP request (JSON, rendering, tool-call parsing, decoding) that asks the router.
- gateway (openai): the same with the `openai` client, whose request building and response
  parsing are a harness's cost on top (the client runs in the same process, as AgentEnv's does).

On a busy machine one run's speed says little, so every mode runs once unmeasured (imports, first
steps), then `--repeats` rounds of the three modes, each round in a rotated order; a mode is
compared with the direct run of the same round, and the ratio reported is the median of those
per-round ratios. Reported: generated tokens/s of the batch (median over rounds), per-turn
latency (p50/p99 over every turn of every round) as the turn's caller sees it (the Rollouter, or
the harness), and the controller process's CPU time per turn (the gateway, its harnesses and
the Rollouter share it, and the replicas share the machine's cores with it). A dated,
commit-stamped row is appended to benchmarks/results/gateway_overhead.md.

    python benchmarks/gateway_overhead.py                 # 64 sessions x 3 turns x 64 tokens, 2 replicas
    python benchmarks/gateway_overhead.py --instant       # the controller's CPU per turn only

With `--instant` no router runs: a generator that answers at once with a fixed completion stands in
for it, and the figure is the controller process's CPU time per turn of each mode (median over the
rounds): the gateway's and the harnesses' own cost, free of the replicas' share of the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from results_table import RESULTS as RESULTS_DIR
from results_table import append_row

WARM_CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "alphabet_sort" / "warm_checkpoint"
RESULTS = RESULTS_DIR / "gateway_overhead.md"
MODES = ("direct", "gateway (HTTP)", "gateway (openai)")
COLUMNS = ("sessions x turns x max tokens", "rounds", *(f"{m} tok/s" for m in MODES), "HTTP / direct (median)",
           "openai / direct (median)", *(f"{m} turn p50 / p99 s" for m in MODES),
           "controller CPU ms per turn (direct / HTTP / openai)")
INSTANT_COLUMNS = ("sessions x turns x max tokens", "rounds", *(f"{m} CPU ms per turn" for m in MODES),
                   "gateway (HTTP) - direct, ms")


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

    async def run(mode: str) -> tuple[list[int], float, float]:
        """The tokens sampled, the wall and the controller CPU seconds of one batch."""
        start, cpu = time.perf_counter(), time.process_time()
        batch = await Rollouter(envs[mode], timed_generate if mode == "direct" else generate,
                                rollout).collect([{"id": 0}])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        rollouts = batch.groups[0].rollouts
        assert all(r.status.value in ("completed", "truncated_length") for r in rollouts), [r.error for r in rollouts]
        turns[mode] += sum(len(r.turns) for r in rollouts)
        return [t for r in rollouts for turn in r.turns for t in turn.token_ids], seconds, cpu

    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_seconds = dict.fromkeys(MODES, 0.0)
    turns = dict.fromkeys(MODES, 0)
    same = True
    try:
        reference, _, _ = await run("direct")  # unmeasured: imports, the first steps of each path
        for mode in MODES[1:]:
            same &= (await run(mode))[0] == reference
        for latency in latencies.values():
            latency.clear()
        turns = dict.fromkeys(MODES, 0)
        for round_ in range(args.repeats):
            for mode in MODES[round_ % 3:] + MODES[:round_ % 3]:
                tokens, seconds, cpu = await run(mode)
                same &= tokens == reference
                rates[mode].append(len(tokens) / seconds)
                cpu_seconds[mode] += cpu
                print(f"  {mode}: {len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / seconds:,.0f} tokens/s, "
                      f"controller CPU {cpu:.2f} s)", flush=True)
        print(f"every run sampled the same tokens: {same}")
        assert same, "the modes sampled different tokens: not the same workload"
    finally:
        await http.close()
        await gateway.stop()
        await router.close.call_one()
        await procs.stop()
    return {"rates": rates, "latencies": latencies,
            "cpu_ms_per_turn": {m: 1000 * cpu_seconds[m] / turns[m] for m in MODES}}


async def instant(args) -> dict[str, float]:
    """Controller CPU ms per turn of each mode (median over rounds), with an instant generator."""
    from rlactors.config import GatewayConfig, RolloutConfig
    from rlactors.gateway import Gateway
    from rlactors.models import load_tokenizer
    from rlactors.rollout import Rollouter
    from rlactors.types import Completion

    tokenizer = load_tokenizer(WARM_CHECKPOINT)
    reply = tokenizer.encode(" ".join(["sort the letters"] * 32), add_special_tokens=False)[:args.max_tokens - 1]
    reply.append(tokenizer.eos_token_id)

    async def generate(prompt, sampling, request_id, session_id=None):
        await asyncio.sleep(0)  # a turn in flight, as a router call is
        return Completion(request_id, list(prompt), list(reply), [-1.0] * len(reply), [0] * len(reply), "stop")

    rollout = RolloutConfig(group_size=args.sessions, prompts_per_step=1, max_turns=args.turns,
                            max_tokens_per_turn=args.max_tokens, max_total_tokens=4096, keep_zero_variance_groups=True,
                            step_timeout_s=600.0)
    gateway = Gateway(GatewayConfig(), tokenizer, rollout.max_tokens_per_turn)
    await gateway.start()
    envs, http = make_envs(tokenizer, {mode: [] for mode in MODES})
    for env in envs.values():
        env.gateway = gateway
    ms_per_turn: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for round_ in range(args.repeats + 1):  # the first round is unmeasured
            for mode in MODES[round_ % 3:] + MODES[:round_ % 3]:
                cpu = time.process_time()
                batch = await Rollouter(envs[mode], generate, rollout).collect([{"id": 0}])
                cpu = time.process_time() - cpu
                if round_:
                    ms_per_turn[mode].append(1000 * cpu / sum(len(r.turns) for r in batch.groups[0].rollouts))
    finally:
        await http.close()
        await gateway.stop()
    return {mode: statistics.median(ms) for mode, ms in ms_per_turn.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6, help="rounds of the three modes")
    parser.add_argument("--no-write", action="store_true", help="print the row without appending it")
    parser.add_argument("--instant", action="store_true",
                        help="no router: an instant generator; report the controller's CPU per turn only")
    args = parser.parse_args()
    if args.instant:
        cpu = asyncio.run(instant(args))
        figures = [f"{args.sessions} x {args.turns} x {args.max_tokens}", args.repeats,
                   *(f"{cpu[m]:.2f}" for m in MODES), f"{cpu['gateway (HTTP)'] - cpu['direct']:.2f}"]
        print(dict(zip(INSTANT_COLUMNS, figures)))
        if not args.no_write:
            append_row(RESULTS, "Controller CPU per turn with an instant generator (--instant)", INSTANT_COLUMNS,
                       figures, device="cpu")
            print(f"added a row to {RESULTS}")
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # replica procs inherit it: one thread each on a small box
    from rlactors.supervision import use_fast_supervision

    use_fast_supervision()
    result = asyncio.run(benchmark(args, WARM_CHECKPOINT))
    rates, lat, cpu = result["rates"], result["latencies"], result["cpu_ms_per_turn"]
    ratio = {m: statistics.median(r / d for r, d in zip(rates[m], rates["direct"])) for m in MODES[1:]}
    p = {m: f"{_percentile(lat[m], 0.5):.3f} / {_percentile(lat[m], 0.99):.3f}" for m in MODES}
    figures = [f"{args.sessions} x {args.turns} x {args.max_tokens}", args.repeats,
               *(f"{statistics.median(rates[m]):,.0f}" for m in MODES), *(f"**{ratio[m]:.2f}x**" for m in MODES[1:]),
               *(p[m] for m in MODES), " / ".join(f"{cpu[m]:.1f}" for m in MODES)]
    print(dict(zip(COLUMNS, figures)))
    if not args.no_write:
        append_row(RESULTS, "Gateway overhead: agents through the gateway vs direct router calls", COLUMNS, figures,
                   device="cpu")
        print(f"added a row to {RESULTS}")


if __name__ == "__main__":
    main()
