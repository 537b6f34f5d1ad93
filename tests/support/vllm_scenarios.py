"""Generation scenarios for tests/engines/test_vllm_true_on_policy.py, in one true on-policy vLLM engine.

Runs in a process of its own (vLLM sets up its own process group and reads its environment at
import): ``python tests/support/vllm_scenarios.py CKPT UPDATED_CKPT OUT_JSON MAX_NUM_SEQS MAX_NUM_TOKENS``.
Writes, per scenario, every completion's prompt, tokens, logprobs and finish reason. The engine
runs with prefix caching and CUDA graphs; with a step budget of 512 tokens, prompts of up to 1024
tokens are prefilled in chunks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.vllm_engine import VLLMEngine
from rlactors.types import SamplingParams

NEW_TOKENS = 24


def run(engine: VLLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling)
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            assert c.finish_reason in ("length", "stop"), (c.request_id, c.finish_reason)
            done[c.request_id] = {"prompt": list(c.prompt_token_ids), "tokens": list(c.token_ids),
                                  "logprobs": list(c.logprobs), "versions": list(c.versions),
                                  "finish_reason": c.finish_reason}
    return done


def main(ckpt: str, updated_ckpt: str, out: str, max_num_seqs: str, max_num_tokens: str) -> None:
    config = GeneratorConfig(engine="vllm", replicas=1, max_num_seqs=int(max_num_seqs),
                             max_num_tokens=int(max_num_tokens), max_model_len=2048, gpu_memory_utilization=0.35)
    engine = VLLMEngine.from_config(config, ModelConfig(path=ckpt, dtype="bfloat16", true_on_policy=True))
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(16, 1025, (1,), generator=g)),), generator=g).tolist()

    def groups(count: int, size: int, temperature: float, tag: str) -> dict:
        """GRPO-like: `size` samples of each prompt, so all but the first hit the prefix cache."""
        return {f"{tag}{i}/{j}": (p, SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, seed=1000 * i + j))
                for i, p in enumerate(prompt() for _ in range(count)) for j in range(size)}

    scenarios = {"t1": run(engine, groups(64, 4, 1.0, "t1/")),      # 256 sequences, temperature 1
                 "t07": run(engine, groups(32, 2, 0.7, "t07/"))}    # another temperature
    mine = (prompt(), SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=7))
    scenarios["alone"] = run(engine, {"mine": mine})
    scenarios["among_256"] = run(engine, {"mine": mine, **groups(51, 5, 1.0, "other/")})
    # Multi-turn: earlier prompts + their completions + env tokens, continued (their prefixes are cached).
    turns = {}
    for i, (request_id, c) in enumerate(list(scenarios["t1"].items())[:64]):
        env_tokens = torch.randint(3, vocab, (8,), generator=g).tolist()
        turns[f"turn2/{request_id}"] = (c["prompt"] + c["tokens"] + env_tokens,
                                        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=i))
    scenarios["turn2"] = run(engine, turns)
    # Completions that end on a stop token (an env's end-of-turn), 16 to a prompt, all at once.
    stops = tuple(range(3, vocab, 24))  # one token id in 24
    scenarios["stops"] = run(engine, {f"stops/{i}/{j}": (p, SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0,
                                                                           seed=100 * i + j, stop_token_ids=stops))
                                      for i, p in enumerate(prompt() for _ in range(32)) for j in range(16)})
    updated = {name: tensor.cuda() for name, tensor in load_file(Path(updated_ckpt) / "model.safetensors").items()}
    engine.load_weights(updated, version=1)
    scenarios["updated"] = run(engine, groups(32, 2, 1.0, "updated/"))
    engine.close()
    Path(out).write_text(json.dumps(scenarios))


if __name__ == "__main__":
    main(*sys.argv[1:6])
