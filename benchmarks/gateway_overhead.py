"""Agents through the gateway vs the same conversations sent to the router directly, same run.

The workload: `--sessions` concurrent chat rollouts of `--turns` turns each (a question, then
"Continue." after every reply, whether the reply ended its turn or was cut by `--max-tokens`),
seeded sampling. It runs three ways on one GeneratorRouter:

- direct: a HarnessEnv plays the conversation with token ids (the chat template's rendering,
  `extend_with_messages`), reads each reply's text, and the Rollouter sends the ids to the router.
- gateway (HTTP): an AgentEnv plays it by posting the JSON itself (aiohttp): the gateway's own
  cost, every turn an HTTP request (JSON, rendering, tool-call parsing, decoding) that asks the router.
- gateway (openai): the same with the `openai` client, whose request building and response
  parsing are a harness's cost on top (the client runs in the same process, as AgentEnv's does).

Only the router differs between devices:
- CPU (default): native replicas (`--replicas`, default 2) on the tiny alphabet_sort policy
  (it ends its turns). The native engine is batch invariant: every mode samples the same tokens
  (checked).
- `--device cuda`: one vLLM replica on GPU 0 with Qwen3-0.6B-shaped random weights (bf16, as
  generator_throughput.py makes them), whose turns all run to `--max-tokens`. vLLM's numerics
  depend on the batch, so the modes' tokens may differ; every mode plays every turn (checked).

On a busy machine one run's speed says little, so every mode runs once unmeasured (imports, first
steps), then `--repeats` rounds of the three modes, each round in a rotated order; a mode is
compared with the direct run of the same round, and the ratio reported is the median of those
per-round ratios. Reported: generated tokens/s of the batch (median over rounds), per-turn
latency (p50/p99 over every turn of every round) as the harness sees it, and the controller
process's CPU time per turn (the gateway, its harnesses and the Rollouter share it). A dated,
commit-stamped row is appended to benchmarks/results/gateway_overhead.md.

    python benchmarks/gateway_overhead.py                 # CPU: 64 sessions x 3 turns x 64 tokens, 2 replicas
    python benchmarks/gateway_overhead.py --device cuda   # GPU 0: 128 sessions x 4 turns x 128 tokens, ~4 min
    python benchmarks/gateway_overhead.py --instant       # the controller's CPU per turn only

With `--instant` no router runs: a generator that answers at once with a fixed completion stands in
for it, and the figures are the controller process's CPU time per turn of each mode (median over the
rounds), the gateway's and the harnesses' own cost free of the replicas' share of the cores, and the
turns' p50 latency (every session's turns queue on the one event loop, so it grows with that cost).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import yarl
from results_table import RESULTS as RESULTS_DIR
from results_table import append_row

WARM_CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "alphabet_sort" / "warm_checkpoint"
RESULTS = RESULTS_DIR / "gateway_overhead.md"
MODES = ("direct", "gateway (HTTP)", "gateway (openai)")
COLUMNS = ("sessions x turns x max tokens", "rounds", *(f"{m} tok/s" for m in MODES), "HTTP / direct (median)",
           "openai / direct (median)", *(f"{m} turn p50 / p99 s" for m in MODES),
           "controller CPU ms per turn (direct / HTTP / openai)")
GPU_COLUMNS = ("replicas", *COLUMNS)  # a table of its own
INSTANT_COLUMNS = ("sessions x turns x max tokens", "rounds", *(f"{m} CPU ms per turn" for m in MODES),
                   "gateway (HTTP) - direct, ms", "turn p50 ms (direct / HTTP / openai)")


@dataclass
class ChatConfig:
    turns: int = 3


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_envs(tokenizer, turns: int, latencies: dict[str, list[float]]):
    from rlactors.gateway import AgentEnv
    from rlactors.models.tokenizer import extend_with_messages, render_messages
    from rlactors.rollout import HarnessEnv

    def question(sample):
        return [{"role": "user", "content": f"Tell me a story about the number {sample['id']}."}]

    follow_up = {"role": "user", "content": "Continue."}

    class DirectChat(HarnessEnv):
        Config = ChatConfig

        def __init__(self, config, tokenizer):
            super().__init__(config, tokenizer)
            self.stop_token_ids = (tokenizer.eos_token_id,)

        async def play(self, sample, model):
            prompt = render_messages(self.tokenizer, question(sample))
            for turn in range(self.config.turns):
                start = time.perf_counter()
                reply = await model(prompt)
                self.tokenizer.decode(reply.token_ids, skip_special_tokens=True)  # the harness reads the reply
                latencies["direct"].append(time.perf_counter() - start)
                if turn + 1 < self.config.turns:
                    prompt = extend_with_messages(self.tokenizer, prompt + reply.token_ids, [follow_up])
            return 0.0

    class ChatAgent(AgentEnv):
        Config = ChatConfig
        mode = "openai"

        async def run(self, sample, client):
            messages = question(sample)
            url = yarl.URL(f"{self.base_url}/chat/completions")
            headers = {"Authorization": f"Bearer {self.api_key}"}
            for turn in range(self.config.turns):
                start = time.perf_counter()
                if self.mode == "openai":
                    response = await client.chat.completions.create(model="policy", messages=messages)
                    message = response.choices[0].message.model_dump(exclude_none=True)
                else:
                    async with http.post(url, json={"model": "policy", "messages": messages}, headers=headers) as r:
                        message = (await r.json(loads=orjson.loads))["choices"][0]["message"]
                latencies[f"gateway ({self.mode})"].append(time.perf_counter() - start)
                messages.append(message)
                if turn + 1 < self.config.turns:
                    messages.append(follow_up)
            return 0.0

    class HttpChatAgent(ChatAgent):
        mode = "HTTP"
        openai_client = False  # it posts the JSON itself

    # The harness's client as a lean aiohttp harness sets it up: no pool limit, orjson, no cookies,
    # no timeout (the rollout's step_timeout_s bounds a turn, as for the sessions' `openai` clients)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), json_serialize_bytes=orjson.dumps,
                                 cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout())
    config = ChatConfig(turns)
    envs = {"direct": DirectChat(config, tokenizer), "gateway (HTTP)": HttpChatAgent(config, tokenizer),
            "gateway (openai)": ChatAgent(config, tokenizer)}
    return envs, http


def start_router(args, scratch: Path):
    """The router of `args.device` (spawned: its replicas start with the first call), its procs, and
    the checkpoint it serves."""
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter
    from rlactors.config import GeneratorConfig, ModelConfig

    if args.device == "cpu":
        procs = this_host().spawn_procs(per_host={"procs": 1})
        generator = GeneratorConfig(replicas=args.replicas, max_num_seqs=args.sessions, max_num_tokens=2048,
                                    kv_cache_tokens=65536, max_model_len=args.max_model_len, restart_dead=False)
        return procs, procs.spawn("router", GeneratorRouter, generator, ModelConfig(path=str(WARM_CHECKPOINT))), \
            WARM_CHECKPOINT
    from rlactors.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(scratch / "qwen3_0.6b", size="0.6b", seed=0)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    generator = GeneratorConfig(engine="vllm", replicas=args.replicas, max_num_seqs=max(256, args.sessions),
                                max_num_tokens=8192, max_model_len=args.max_model_len,
                                gpu_memory_utilization=0.8 / (args.replicas + 1), restart_dead=False)
    router = procs.spawn("router", GeneratorRouter, generator, ModelConfig(path=str(ckpt), dtype="bfloat16"),
                         [[0]] * args.replicas)  # the replicas share GPU 0
    return procs, router, ckpt


async def benchmark(args, scratch: Path) -> dict[str, object]:
    from rlactors.config import GatewayConfig, RolloutConfig
    from rlactors.gateway import Gateway
    from rlactors.models import load_tokenizer
    from rlactors.rollout import Rollouter

    procs, router, ckpt = start_router(args, scratch)
    tokenizer = load_tokenizer(ckpt)
    rollout = RolloutConfig(group_size=args.sessions, prompts_per_step=1, max_turns=args.turns,
                            max_tokens_per_turn=args.max_tokens, max_total_tokens=args.max_model_len,
                            keep_zero_variance_groups=True, step_timeout_s=600.0)
    gateway = Gateway(GatewayConfig(), tokenizer, rollout.max_tokens_per_turn)
    await gateway.start()
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}

    async def generate(prompt, sampling, request_id, session_id=None):
        return await router.generate.call_one(prompt, sampling, request_id, session_id)

    envs, http = make_envs(tokenizer, args.turns, latencies)
    for env in envs.values():
        env.gateway = gateway

    async def run(mode: str) -> tuple[list[int], float, float]:
        """The tokens sampled, the wall and the controller CPU seconds of one batch."""
        start, cpu = time.perf_counter(), time.process_time()
        batch = await Rollouter(envs[mode], generate, rollout).collect([{"id": 0}])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        rollouts = batch.groups[0].rollouts
        assert all(r.status.value in ("completed", "truncated_length") for r in rollouts), [r.error for r in rollouts]
        played = sum(len(r.turns) for r in rollouts)
        assert played == args.sessions * args.turns, f"{mode}: {played} turns, not {args.sessions} x {args.turns}"
        turns[mode] += played
        return [t for r in rollouts for turn in r.turns for t in turn.token_ids], seconds, cpu

    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_seconds = dict.fromkeys(MODES, 0.0)
    turns = dict.fromkeys(MODES, 0)
    same = True
    try:
        reference, _, _ = await run("direct")  # unmeasured: the replicas' start, imports, the first steps
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
                      f"controller CPU {cpu:.2f} s, load average {os.getloadavg()[0]:.1f})", flush=True)
        print(f"every run sampled the same tokens: {same}")
        # The native engine's tokens do not depend on the batch; vLLM's may (module docstring).
        assert same or args.device == "cuda", "the modes sampled different tokens: not the same workload"
    finally:
        await http.close()
        await gateway.stop()
        await router.close.call_one()
        await procs.stop()
    return {"rates": rates, "latencies": latencies,
            "cpu_ms_per_turn": {m: 1000 * cpu_seconds[m] / turns[m] for m in MODES}}


async def instant(args) -> tuple[dict[str, float], dict[str, float]]:
    """Controller CPU ms per turn of each mode (median over rounds) and its turns' p50 latency in ms
    (over the measured rounds), with an instant generator."""
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
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    envs, http = make_envs(tokenizer, args.turns, latencies)
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
                else:
                    latencies[mode].clear()
    finally:
        await http.close()
        await gateway.stop()
    return ({mode: statistics.median(ms) for mode, ms in ms_per_turn.items()},
            {mode: 1000 * _percentile(latencies[mode], 0.5) for mode in MODES})


# Per device: sessions, turns, max tokens, replicas, rounds, max_model_len (the rollouts' max_total_tokens too).
# On a GPU 8 rounds: the median of 4 is the mean of the middle two, and one slow round moves it.
DEFAULTS = {"cpu": (64, 3, 64, 2, 6, 1024),
            "cuda": (128, 4, 128, 1, 8, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=tuple(DEFAULTS), default="cpu")
    parser.add_argument("--sessions", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--replicas", type=int, help="generator replicas (on GPU: all on GPU 0)")
    parser.add_argument("--repeats", type=int, help="rounds of the three modes")
    parser.add_argument("--no-write", action="store_true", help="print the row without appending it")
    parser.add_argument("--instant", action="store_true",
                        help="no router: an instant generator; report the controller's CPU and latency per turn only")
    args = parser.parse_args()
    names = ("sessions", "turns", "max_tokens", "replicas", "repeats", "max_model_len")
    for name, default in zip(names, DEFAULTS[args.device]):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if args.instant:
        cpu, p50 = asyncio.run(instant(args))
        figures = [f"{args.sessions} x {args.turns} x {args.max_tokens}", args.repeats,
                   *(f"{cpu[m]:.2f}" for m in MODES), f"{cpu['gateway (HTTP)'] - cpu['direct']:.2f}",
                   " / ".join(f"{p50[m]:.1f}" for m in MODES)]
        print(dict(zip(INSTANT_COLUMNS, figures)))
        if not args.no_write:
            append_row(RESULTS, "Controller CPU per turn with an instant generator (--instant)", INSTANT_COLUMNS,
                       figures, device="cpu")
            print(f"added a row to {RESULTS}")
        return
    on_gpu = args.device == "cuda"
    if not on_gpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # replica procs inherit it: one thread each on a small box
    from rlactors.procs.supervision import use_fast_supervision

    use_fast_supervision()
    with tempfile.TemporaryDirectory() as scratch:
        result = asyncio.run(benchmark(args, Path(scratch)))
    rates, lat, cpu = result["rates"], result["latencies"], result["cpu_ms_per_turn"]
    per_round = {m: [r / d for r, d in zip(rates[m], rates["direct"])] for m in MODES[1:]}
    for m in MODES[1:]:
        print(f"{m} / direct, each round: {' '.join(f'{x:.2f}' for x in per_round[m])}")
    ratio = {m: statistics.median(per_round[m]) for m in MODES[1:]}
    p = {m: f"{_percentile(lat[m], 0.5):.3f} / {_percentile(lat[m], 0.99):.3f}" for m in MODES}
    figures = [f"{args.sessions} x {args.turns} x {args.max_tokens}", args.repeats,
               *(f"{statistics.median(rates[m]):,.0f}" for m in MODES),
               *(f"**{ratio[m]:.{3 if on_gpu else 2}f}x**" for m in MODES[1:]),
               *(p[m] for m in MODES), " / ".join(f"{cpu[m]:.1f}" for m in MODES)]
    columns = COLUMNS
    if on_gpu:
        columns, figures = GPU_COLUMNS, [f"{args.replicas} x vLLM, Qwen3-0.6B-shaped random bf16", *figures]
    print(dict(zip(columns, figures)))
    if not args.no_write:
        append_row(RESULTS, "Gateway overhead: agents through the gateway vs direct router calls", columns, figures,
                   device=args.device)
        print(f"added a row to {RESULTS}")


if __name__ == "__main__":
    main()
