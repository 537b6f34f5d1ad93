"""LoRA on a GPU, in bf16: native-engine true on-policy with adapters gives the trainer core's
logprobs bit for bit (the merge by the Triton batch-invariant matmul on both sides; the trainer's
frozen base in bf16 beside fp32 adapters under FSDP's mixed precision)."""

import pytest
import torch
from support.lora import assert_lora_true_on_policy_diff_is_zero
from support.trainer_inputs import one_rank_process_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def device():
    with one_rank_process_group("cuda") as device:
        yield device


def test_native_true_on_policy_with_lora_on_cuda_logprob_diff_is_zero(tiny_ckpt, device, tmp_path):
    assert_lora_true_on_policy_diff_is_zero(tiny_ckpt, device, tmp_path, dtype="bfloat16")
