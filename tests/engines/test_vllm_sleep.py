"""vLLM's sleep as `generator.sleep` uses it (GPU): level 1 frees the replica's memory, and after
waking the weights, loading the policy and waking the KV cache, seeded completions are the same
tokens and logprobs as before. Skipped without CUDA and vLLM; its own group in
benchmarks/gpu_suite.py, a process whose allocator grew no expandable segments before the engine
turned them off."""

from __future__ import annotations

import os

import torch
from support.vllm_checks import NEEDS_VLLM_GPU, prompts, run

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.models.checkpoint import load_state_dict
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.types import SamplingParams

pytestmark = NEEDS_VLLM_GPU

CONFIG = GeneratorConfig(engine="vllm", replicas=1, max_num_seqs=64, max_num_tokens=2048, max_model_len=512,
                         gpu_memory_utilization=0.3, sleep=True)


def test_completions_after_sleep_weight_load_and_wake_equal_those_before(tmp_path, monkeypatch):
    from rlactors.engines.vllm_engine import VLLMEngine

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # as they were, after the engine drops
        monkeypatch.setenv(name, os.environ.get(name, ""))         # expandable segments from them

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="small", seed=0, dtype="bfloat16")
    engine = VLLMEngine.from_config(CONFIG, ModelConfig(path=str(ckpt), dtype="bfloat16"))
    try:
        requests = {f"r{i}": (p, SamplingParams(max_tokens=24, temperature=1.0, seed=i))
                    for i, p in enumerate(prompts(16))}
        before = run(engine, requests)
        free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - free
        share = CONFIG.gpu_memory_utilization * torch.cuda.mem_get_info()[1]
        assert freed > 0.9 * share, f"sleep freed {freed / 2**30:.1f} GiB of a {share / 2**30:.1f} GiB share"
        engine.wake_up(["weights"])
        engine.load_weights({k: v.cuda() for k, v in load_state_dict(ckpt).items()}, version=1)
        engine.wake_up(["kv_cache"])
        after = run(engine, requests)
        for rid, completion in before.items():
            assert after[rid].token_ids == completion.token_ids, rid
            assert after[rid].logprobs == completion.logprobs, rid
            assert after[rid].versions == [1] * len(completion.token_ids)
    finally:
        engine.close()
