"""LoRA on a GPU, in bf16: true on-policy with adapters gives the trainer's logprobs bit for bit,
in the native engine against the trainer core and in whole one-GPU runs with a vLLM replica (the
merge by the Triton batch-invariant matmul on both sides; the trainer's frozen base in bf16 beside
fp32 adapters under FSDP's mixed precision)."""

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch
from support.lora import assert_lora_true_on_policy_diff_is_zero
from support.trainer_inputs import one_rank_process_group
from support.vllm_checks import vllm_run_config

from rlactors.models.checkpoint import load_state_dict
from rlactors.models.tiny import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def device():
    with one_rank_process_group("cuda") as device:
        yield device


def test_native_true_on_policy_with_lora_on_cuda_logprob_diff_is_zero(tiny_ckpt, device, tmp_path):
    assert_lora_true_on_policy_diff_is_zero(tiny_ckpt, device, tmp_path, dtype="bfloat16")


# -- vLLM: adapters synced alone, merged into the replica's base (rlactors.lora.replica) -----------

DEMO_MOE = Path(__file__).resolve().parents[2] / "examples" / "alphabet_sort" / "warm_checkpoint_moe"
VLLM_LORA_RUNS = {
    # the Qwen3-0.6B shape with random bf16 weights, every linear adapted; the engine sleeps while
    # the trainer steps (so each merge lands in weights vLLM offloaded and brought back)
    "0.6b": ("model.lora.rank=8", "generator.sleep=true", 'controller.mode="sync"'),
    # the MoE demo's model, its attention adapted (experts cannot be)
    "moe": ("model.lora.rank=8", "model.lora.target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']",
            'controller.mode="async"'),
}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
@pytest.mark.parametrize("model", sorted(VLLM_LORA_RUNS))
def test_vllm_true_on_policy_with_lora_logprob_diff_is_zero_on_every_step(model, tmp_path):
    """One GPU shared by the trainer and a true on-policy vLLM replica: with adapters (lora_B
    moves from 0 at the first step) the trainer's logprobs equal vLLM's bit for bit at every
    step, and weight sync carries the adapters alone."""
    from rlactors.run.controller import Controller

    if model == "moe":
        ckpt = DEMO_MOE
    else:
        ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="0.6b", seed=0, dtype="bfloat16")
    config = vllm_run_config(ckpt, tmp_path / "run", "model.true_on_policy=true", "controller.colocate=true",
                             "controller.steps=4", "trainer.lr=1e-2", *VLLM_LORA_RUNS[model])
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    assert [m["loss/logprob_diff/max"] for m in history] == [0.0] * 4, history
    full_bytes = sum(t.numel() * 2 for t in load_state_dict(ckpt, "cpu").values())
    assert all(0 < m["weight_sync/bytes"] < full_bytes / 10 for m in history), history


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_vllm_default_mode_with_lora_merges_into_vllms_fused_weights(tmp_path):
    """The default mode: vLLM's own Qwen3 (fused qkv_proj and gate_up_proj) gets the adapters
    merged into its fused rows; its logprobs agree with the trainer's to bf16 rounding (rows
    merged in the wrong place would not)."""
    from rlactors.run.controller import Controller

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="small", seed=0, dtype="bfloat16")
    config = vllm_run_config(ckpt, tmp_path / "run", "controller.colocate=true", "controller.steps=3",
                             "trainer.lr=1e-2", "model.lora.rank=8")
    history = asyncio.run(Controller(config).run())
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0]
    assert all(m["loss/logprob_diff/mean"] < 0.05 and m["loss/mismatch_kl/mean"] < 0.01 for m in history), history
