"""Generation throughput, side by side on the same prompts.

CPU (default): the native engine (continuous batching) vs HF transformers `generate` (static
batches) vs one request at a time, on the tiny checkpoint: 64 prompts of mixed lengths, the same
max_tokens, greedy, no early stop. Every method produces the same number of tokens; each is run
`--repeats` times, interleaved, and its best time is kept.

    python benchmarks/generator_throughput.py                      # CPU: a row in results/generator_throughput_cpu.md

GPU: Router -> Generator(vLLM) in Monarch procs vs vLLM's own `LLM.generate`, same prompts and
checkpoint (Qwen3-0.6B-shaped random weights), sampling at temperature 1 with per-request seeds.

    python benchmarks/generator_throughput.py --device cuda        # a row in results/generator_throughput_gpu.md

Prints the full report and adds a row to the results table (results_table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_table import RESULTS, append_row

CPU_COLUMNS = ("workload", "native tokens/s", "best HF static batches tokens/s", "HF one at a time tokens/s",
               "native vs best HF (wall)", "native vs best HF (CPU)")
GPU_COLUMNS = ("shape", "replicas", "tp", "workload", "raw vLLM tokens/s per run", "router tokens/s per run",
               "router / raw per run", "median router / raw")


def make_prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in lengths]


def timed(fn) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, tokens). On a shared machine CPU time is the
    steadier measure: it does not count the time other processes hold the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


# -- CPU -----------------------------------------------------------------------------------------


def native_run(model, prompts, max_tokens: int, max_num_seqs: int) -> int:
    from rlactors.config import GeneratorConfig
    from rlactors.engines.native import NativeEngine
    from rlactors.types import SamplingParams

    engine = NativeEngine(model, GeneratorConfig(max_num_seqs=max_num_seqs, max_num_tokens=2048, kv_cache_tokens=65536,
                                                 block_size=16, max_model_len=2048))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for c in engine.step())
    return tokens


def hf_run(hf_model, prompts, max_tokens: int, batch_size: int) -> int:
    tokens = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                                    do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(batch)
    return tokens


def cpu_benchmark(args) -> tuple[str, list]:
    """The report, and the figures of its results row."""
    from transformers import AutoModelForCausalLM

    from rlactors.models.checkpoint import from_pretrained
    from rlactors.models.tiny import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", size="tiny", seed=0)
        model = from_pretrained(ckpt, dtype="float32")
        hf_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None  # no early stop, like the native engine here
    prompts = make_prompts(args.num_prompts, args.min_prompt, args.max_prompt, model.args.vocab_size)
    expected = len(prompts) * args.max_tokens
    methods = {
        "native engine (continuous batching)": lambda: native_run(model, prompts, args.max_tokens, len(prompts)),
        **{f"HF generate, static batches of {b}": (lambda b=b: hf_run(hf_model, prompts, args.max_tokens, b))
           for b in args.hf_batch_sizes},
        "HF generate, one request at a time": lambda: hf_run(hf_model, prompts, args.max_tokens, 1),
    }
    wall = {name: float("inf") for name in methods}
    cpu = dict(wall)
    for repeat in range(args.repeats):
        for name, fn in methods.items():
            if repeat > 0 and name.endswith("one request at a time"):
                continue  # slow and steady: one run is enough
            wall_s, cpu_s, tokens = timed(fn)
            assert tokens == expected, f"{name}: {tokens} tokens, expected {expected}"
            wall[name], cpu[name] = min(wall[name], wall_s), min(cpu[name], cpu_s)
            print(f"  {name}: {wall_s:.2f} s wall, {cpu_s:.2f} s CPU ({tokens / wall_s:,.0f} tokens/s)", flush=True)
    native = "native engine (continuous batching)"
    rows = [f"| {name} | {wall[name]:.2f} | {expected / wall[name]:,.0f} | {wall[name] / wall[native]:.2f}x "
            f"| {cpu[name]:.2f} | {cpu[name] / cpu[native]:.2f}x |" for name in methods]
    static = [n for n in methods if n.startswith("HF generate, static")]
    vs_wall = min(wall[n] for n in static) / wall[native]
    vs_cpu = min(cpu[n] for n in static) / cpu[native]
    best_static = min(static, key=wall.get)
    figures = [f"{len(prompts)} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} new, "
               f"best of {args.repeats}, {args.threads} thread(s)",
               f"{expected / wall[native]:,.0f}", f"{expected / wall[best_static]:,.0f}",
               f"{expected / wall['HF generate, one request at a time']:,.0f}", f"{vs_wall:.2f}x", f"{vs_cpu:.2f}x"]
    lines = [
        "# Generator throughput (CPU)",
        "",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores "
        f"(shared), torch {torch.__version__}, {args.threads} intra-op thread(s).",
        f"Command: `{' '.join(['python benchmarks/generator_throughput.py', *sys.argv[1:]])}`",
        "",
        f"Tiny Qwen3 checkpoint (fp32, {model.args.num_hidden_layers} layers, hidden {model.args.hidden_size}, "
        f"vocab {model.args.vocab_size}); {len(prompts)} prompts of {args.min_prompt}-{args.max_prompt} tokens "
        f"(mean {sum(map(len, prompts)) / len(prompts):.0f}); {args.max_tokens} new tokens each, greedy, no early "
        f"stop ({expected} tokens per method). Best of {args.repeats} interleaved runs "
        "(one run for one-at-a-time).",
        "",
        "| method | wall s | generated tokens/s | native speedup (wall) | CPU s | native speedup (CPU) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Native engine vs the best HF static batching: **{vs_wall:.2f}x** wall clock, **{vs_cpu:.2f}x** "
        "CPU time (goal >= 2x).",
        "",
    ]
    return "\n".join(lines), figures


# -- GPU -----------------------------------------------------------------------------------------


def raw_vllm_run(ckpt: str, prompt_sets, max_tokens: int, config, shard: int = 0,
                 barrier: Path | None = None) -> list[float]:
    """Seconds of `LLM.generate` on each prompt set (new prompts each time: no prefix-cache hits).

    With `config.replicas` > 1, this process is replica `shard` of as many running side by side:
    it generates every `replicas`-th prompt, and each timed run starts once every replica is
    ready for it (files in the `barrier` dir); a run's time is then the slowest replica's."""
    from rlactors.engines.vllm_engine import custom_all_reduce_works, one_start_per_gpu
    from rlactors.vllm_api import LLM
    from rlactors.vllm_api import SamplingParams as VLLMSamplingParams

    with one_start_per_gpu(config.tp):  # as the router's replicas start: in turn on a shared GPU
        llm = LLM(model=ckpt, dtype="bfloat16", gpu_memory_utilization=config.gpu_memory_utilization,
                  tensor_parallel_size=config.tp,
                  max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                  max_num_batched_tokens=config.max_num_tokens, enable_prefix_caching=True,
                  # as the router's engines: vLLM's TP workers exit at start where it cannot work
                  disable_custom_all_reduce=not custom_all_reduce_works(config.tp))
    params = [VLLMSamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True, logprobs=0,
                                 detokenize=False) for i in range(len(prompt_sets[0]))][shard::config.replicas]
    warm = [{"prompt_token_ids": p[:4]} for p in prompt_sets[0][:8]]
    llm.generate(warm, params[:8], use_tqdm=False)  # warm up
    seconds = []
    for run, prompts in enumerate(prompt_sets):
        inputs = [{"prompt_token_ids": p} for p in prompts[shard::config.replicas]]
        if barrier is not None:
            (barrier / f"{run}.{shard}").touch()
            while len(list(barrier.glob(f"{run}.*"))) < config.replicas:
                time.sleep(0.01)
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(inputs) * max_tokens
    del llm
    return seconds


async def router_vllm_run(ckpt: str, prompt_sets, max_tokens: int, config) -> list[float]:
    """Seconds of GeneratorRouter -> Generator(vLLM) on each prompt set, as `raw_vllm_run`."""
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter
    from rlactors.config import ModelConfig
    from rlactors.types import SamplingParams

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    router = procs.spawn("router", GeneratorRouter, config, ModelConfig(path=ckpt, dtype="bfloat16"),
                         [list(range(config.tp))] * config.replicas)  # the replicas share GPUs 0..tp-1
    warm = [router.generate.call_one(p[:4], SamplingParams(max_tokens=max_tokens, seed=i), f"w{i}")
            for i, p in enumerate(prompt_sets[0][:8])]
    await asyncio.gather(*warm)
    states = (await router.stats.call_one())["states"]
    if states["serving"] != config.replicas:
        raise RuntimeError(f"{states['serving']} of {config.replicas} replicas serve after the warm-up: {states}")
    seconds = []
    for repeat, prompts in enumerate(prompt_sets):
        start = time.perf_counter()
        done = await asyncio.gather(*(router.generate.call_one(p, SamplingParams(max_tokens=max_tokens, seed=i),
                                                               f"r{repeat}/{i}") for i, p in enumerate(prompts)))
        seconds.append(time.perf_counter() - start)
        assert sum(len(c.token_ids) for c in done) == len(prompts) * max_tokens
    await router.close.call_one()
    await procs.stop()
    return seconds


def child_result(child: subprocess.Popen) -> list[float]:
    """The seconds a `--method` child process printed, once it has ended."""
    import json

    out, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(child.args)} exited with {child.returncode}")
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:])


def gpu_benchmark(args) -> tuple[str, list]:
    """The report and the figures of its results row; in a `--method` child, ("", [])."""
    import json
    import statistics

    from rlactors.config import GeneratorConfig
    from rlactors.models.tiny import make_tiny_checkpoint

    if args.checkpoint is None:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint = str(make_tiny_checkpoint(Path(tmp) / f"qwen3_{args.size}", size=args.size, seed=0))
            return gpu_benchmark(args)
    ckpt = args.checkpoint
    config = GeneratorConfig(engine="vllm", replicas=args.replicas, tp=args.tp, max_num_seqs=256, max_num_tokens=8192,
                             max_model_len=2048, gpu_memory_utilization=0.8 / (args.replicas + 1))
    prompt_sets = [make_prompts(args.num_prompts, args.min_prompt, args.max_prompt, 151936, seed=run)
                   for run in range(args.repeats)]
    expected = args.num_prompts * args.max_tokens
    if args.method == "raw":
        barrier = Path(args.barrier) if args.barrier else None
        print(f"RESULT {json.dumps(raw_vllm_run(ckpt, prompt_sets, args.max_tokens, config, args.shard, barrier))}")
        return "", []
    if args.method == "router":
        print(f"RESULT {json.dumps(asyncio.run(router_vllm_run(ckpt, prompt_sets, args.max_tokens, config)))}")
        return "", []
    # Each method in its own process, so that one's GPU memory never limits the other; in each, one
    # engine start and `--repeats` timed runs on new prompts.
    # With several replicas, raw vLLM is as many LLM processes side by side, each on its share of
    # the prompts, and a run lasts as long as the slowest.
    command = [sys.executable, __file__, *sys.argv[1:], "--checkpoint", ckpt]
    with tempfile.TemporaryDirectory() as barrier:
        raw = [subprocess.Popen([*command, "--method", "raw", "--shard", str(shard), "--barrier", barrier],
                                stdout=subprocess.PIPE, text=True) for shard in range(args.replicas)]
        shards = [child_result(child) for child in raw]
    seconds = {"raw": [max(run) for run in zip(*shards)],
               "router": child_result(subprocess.Popen([*command, "--method", "router"], stdout=subprocess.PIPE,
                                                       text=True))}
    ratios = [raw / router for raw, router in zip(seconds["raw"], seconds["router"])]
    rows = [f"| {run + 1} | {expected / raw:,.0f} | {expected / router:,.0f} | {ratio:.3f} |"
            for run, (raw, router, ratio) in enumerate(zip(seconds["raw"], seconds["router"], ratios))]
    figures = [f"Qwen3-{args.size.upper()}", args.replicas, args.tp,
               f"{args.num_prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.max_tokens} new",
               ", ".join(f"{expected / s:,.0f}" for s in seconds["raw"]),
               ", ".join(f"{expected / s:,.0f}" for s in seconds["router"]),
               ", ".join(f"{r:.3f}" for r in ratios), f"**{statistics.median(ratios):.3f}**"]
    return "\n".join([
        "# Generator throughput (GPU)",
        "",
        f"Date: {datetime.date.today()}; {torch.cuda.get_device_name(0)}"
        f"{f' x {args.tp}, tensor parallel' if args.tp > 1 else ''}; torch {torch.__version__}.",
        f"Command: `{' '.join(['python benchmarks/generator_throughput.py', *sys.argv[1:]])}`",
        "",
        f"Qwen3-{args.size.upper()}-shaped random weights (bf16); {args.num_prompts} prompts of {args.min_prompt}-"
        f"{args.max_prompt} tokens; {args.max_tokens} new tokens each, temperature 1, seeded, logprobs of sampled "
        "tokens. Each method in its own process: one engine start, then one timed run per prompt set (new "
        "prompts each run, the same sets for both methods).",
        *([] if args.replicas == 1 else [
            "", f"{args.replicas} replicas sharing the one GPU ({config.gpu_memory_utilization:.2f} of its memory "
            f"each): the router over {args.replicas} Generator(vLLM) replicas against {args.replicas} `LLM` "
            f"processes side by side, each given one prompt in {args.replicas}, timed from a common start to the "
            "last one's end."]),
        "",
        "| run | vLLM `LLM.generate` tokens/s | GeneratorRouter -> Generator(vLLM) tokens/s | router / raw |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Router / raw vLLM: median **{statistics.median(ratios):.3f}**, min {min(ratios):.3f} "
        "(goal >= 0.97 in every run).",
        "",
    ]), figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads for every method")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", choices=("raw", "router"), help=argparse.SUPPRESS)  # GPU child process
    parser.add_argument("--checkpoint", help="GPU: an existing checkpoint dir instead of a new random one")
    parser.add_argument("--size", choices=("0.6b", "1.7b"), default="0.6b", help="GPU: the random checkpoint's shape")
    parser.add_argument("--replicas", type=int, default=1, help="GPU: vLLM replicas, all on GPU 0 (or GPUs 0..tp-1)")
    parser.add_argument("--tp", type=int, default=1, help="GPU: tensor-parallel GPUs per replica")
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)  # GPU raw child: its replica
    parser.add_argument("--barrier", help=argparse.SUPPRESS)  # GPU raw children: where they meet before each run
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    args.num_prompts = args.num_prompts or (1024 if on_gpu else 64)
    args.max_prompt = args.max_prompt or (1024 if on_gpu else 512)
    args.max_tokens = args.max_tokens or (256 if on_gpu else 64)
    report, figures = gpu_benchmark(args) if on_gpu else cpu_benchmark(args)
    if report:
        print(report)
        out = RESULTS / f"generator_throughput_{'gpu' if on_gpu else 'cpu'}.md"
        title = "Generator throughput: router vs raw vLLM (GPU)" if on_gpu else "Generator throughput (CPU)"
        append_row(out, title, GPU_COLUMNS if on_gpu else CPU_COLUMNS, figures, device=args.device)
        print(f"added a row to {out}")


if __name__ == "__main__":
    main()
