"""The native engine generates Qwen3-MoE on a GPU, in bf16: in true on-policy mode (the Triton
kernels, all experts in one grouped launch) a request's tokens, logprobs and experts are the same
alone and among 6 others, and the trainer core on the same GPU routes every token to the same
experts and computes the same logprobs, bit for bit; in default mode (torch's grouped GEMM) the
engine returns every token's experts and the trainer's logprobs are near the engine's."""

import pytest
import torch
from support.trainer_inputs import one_rank_process_group
from support.true_on_policy import (
    assert_moe_routes_and_scores_as_the_trainer,
    episode,
    generate,
    make_core,
    prompts,
    requests_with,
    trainer_and_generator_logprobs,
)

from rlactors.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def device():
    with one_rank_process_group("cuda") as device:
        yield device


def test_native_moe_on_cuda_routes_and_scores_as_the_trainer_bit_for_bit(family_ckpt, device):
    assert_moe_routes_and_scores_as_the_trainer(family_ckpt("qwen3_moe", False), device, dtype="bfloat16")


def test_native_moe_on_cuda_in_default_mode_returns_experts_and_near_logprobs(family_ckpt, device):
    ckpt = family_ckpt("qwen3_moe", False)
    requests = requests_with((prompts(1, seed=7)[0], SamplingParams(max_tokens=16, seed=3)), 6, seed=8)
    completions = generate(ckpt, False, requests, max_num_tokens=64, device=device, dtype="bfloat16")
    assert all(len(c.routed_experts) == len(c.token_ids) for c in completions.values())
    core = make_core(ckpt, device, true_on_policy=False, dtype="bfloat16")
    trainer, generator = trainer_and_generator_logprobs(core, [episode(c) for c in completions.values()], 1024)
    # bf16 kernels chosen by the batch's shape on each side: near, not equal
    assert (trainer - generator).abs().max() < 0.25
