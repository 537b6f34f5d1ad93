"""Native engine throughput on CPU: generated tokens/s of a random-init checkpoint of one model
family, in the default and the true on-policy mode.

    .venv/bin/python benchmarks/native_engine_throughput.py [--family qwen3|qwen2|llama] [--size tiny|small]

`--prompts` prompts of 16-`--max-prompt` tokens, `--max-tokens` new tokens each, greedy, no early
stop, all admitted at once; the best of `--repeats` runs is kept. It imports whatever `rlactors`
resolves to, so `PYTHONPATH=OTHER_TREE` measures another version of the code (`--family` needs
one that knows model families).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def generate(model, prompts: list[list[int]], max_tokens: int, true_on_policy: bool) -> float:
    """Seconds to generate every completion in one engine."""
    from rlactors.config import GeneratorConfig
    from rlactors.engines.native import NativeEngine
    from rlactors.types import SamplingParams

    engine = NativeEngine(model, GeneratorConfig(max_num_seqs=len(prompts), max_num_tokens=2048, kv_cache_tokens=65536,
                                                 block_size=16, max_model_len=2048), true_on_policy=true_on_policy)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for c in engine.step())
    assert tokens == len(prompts) * max_tokens
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=None, help="qwen3, qwen2 or llama (default: the factory's, qwen3)")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from rlactors.models.checkpoint import from_pretrained
    from rlactors.models.tiny import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    family = {} if args.family is None else {"family": args.family}
    with tempfile.TemporaryDirectory() as tmp:
        model = from_pretrained(make_tiny_checkpoint(Path(tmp) / "ckpt", size=args.size, seed=0, **family),
                                dtype="float32")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, args.max_prompt + 1, (args.prompts,), generator=g)
    prompts = [torch.randint(3, model.args.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    tokens = args.prompts * args.max_tokens
    for true_on_policy in (False, True):
        best = min(generate(model, prompts, args.max_tokens, true_on_policy) for _ in range(args.repeats))
        mode = "true_on_policy" if true_on_policy else "default"
        print(f"{args.family or 'qwen3'} {args.size} {mode}: {tokens / best:.0f} tokens/s "
              f"(best of {args.repeats}, {best:.3f} s)", flush=True)


if __name__ == "__main__":
    main()
