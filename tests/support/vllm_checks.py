"""What the vLLM engine tests share: their marks (a GPU and vLLM), a short alphabet_sort run on
vLLM, random prompts, running requests to the end, the worst difference between vLLM's logprobs
and our fp32 model's, a scenario completion as an episode, and the trainer's paged attention
queried as a vLLM step queries it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlactors.rollout.types import Episode, RolloutStatus

# A module of tests that need a GPU and vLLM: `pytestmark = NEEDS_VLLM_GPU`.
NEEDS_VLLM_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

def vllm_run_config(ckpt, run_dir, *extra: str):
    """A short alphabet_sort run of `ckpt` (bf16) with one vLLM replica and one trainer rank on CUDA;
    `extra` overrides come last and win."""
    from rlactors.config import load_config

    return load_config(None, [
        f'model.path="{ckpt}"', 'model.dtype="bfloat16"', f'controller.run_dir="{run_dir}"', 'controller.device="cuda"',
        'generator.engine="vllm"', "generator.replicas=1", "generator.gpu_memory_utilization=0.3",
        "generator.max_model_len=512", "trainer.ranks=1", "trainer.lr=1e-3", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_turns=2", "rollout.max_tokens_per_turn=48", "rollout.max_total_tokens=512",
        "rollout.keep_zero_variance_groups=true", "batcher.row_tokens=2048",
        "env.args={ max_turns = 2, max_names_per_turn = 2 }", *extra])


# bf16 generator against an fp32 reference of the same weights: logprobs agree to bf16 rounding.
LOGPROB_ATOL = 0.1


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (int(k),), generator=g).tolist() for k in torch.randint(4, 100, (n,), generator=g)]


def run(engine, requests: dict) -> dict:
    """`requests` (request id -> (prompt, sampling)) through `engine` to the end: id -> Completion."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    return done


def max_logprob_error(model, completions) -> float:
    """The largest |vLLM - `model`| logprob over every generated token (`model` on CUDA)."""
    worst = 0.0
    for c in completions:
        ids = torch.tensor(c.prompt_token_ids + c.token_ids, device="cuda")
        with torch.no_grad():
            hidden = model.forward_packed(ids, torch.arange(len(ids), device="cuda"), backend="sdpa")
            ref = model.token_logprobs(hidden[:-1], ids[1:])[len(c.prompt_token_ids) - 1:].cpu()
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def scenario_episode(c: dict) -> Episode:
    """A completion of tests/support/vllm_scenarios.py (prompt, tokens, logprobs, versions) as an
    episode whose generated tokens are its loss tokens."""
    n, m = len(c["prompt"]), len(c["tokens"])
    return Episode(token_ids=c["prompt"] + c["tokens"], loss_mask=[False] * n + [True] * m,
                   generator_logprobs=[0.0] * n + c["logprobs"], advantages=[0.0] * n + [1.0] * m,
                   versions=[-1] * n + c["versions"], group_id="g", rollout_index=0, branch=0, reward=0.0,
                   status=RolloutStatus.COMPLETED)


def attention_of_last_queries(length: int, queries: int):
    """The trainer's `PagedFlashAttention` over one document of `length` tokens, queried only at its
    last `queries` tokens, as a vLLM step queries a document (a decode step: 1; a prefill chunk:
    more); `forward_values(q[-queries:], k, v)`."""
    from rlactors.on_policy.vllm_model import PagedFlashAttention

    attention = PagedFlashAttention(torch.tensor([0, length], device="cuda"), length)
    attention.cu_seqlens_q = torch.tensor([0, queries], device="cuda", dtype=torch.int32)
    attention.max_seqlen_q = queries
    return attention
