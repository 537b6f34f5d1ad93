"""True on-policy as a conversion (rlactors.on_policy.modules) and the one choice of kernels
(rlactors.on_policy.sides): the plain decoder's modules are swapped in place, names, ties and
values kept; each side gets the kernels of its generator."""

import pytest
import torch
from torch import nn

from rlactors.models.checkpoint import from_pretrained
from rlactors.models.decoder import LogSoftmax, RMSNorm
from rlactors.on_policy import modules
from rlactors.on_policy.attention import BatchInvariantAttention, BatchInvariantPagedAttention
from rlactors.on_policy.sides import NativeEngineSide, VLLMSide, sides
from rlactors.on_policy.vllm_model import PagedFlashAttention, VLLMLogSoftmax, share_replica_nccl_settings


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_conversion_swaps_every_module_in_place_and_keeps_names_ties_and_values(family, family_ckpt):
    model = from_pretrained(family_ckpt(family))
    names = list(model.state_dict())
    embedding = model.model.embed_tokens.weight
    positions = torch.cat([torch.arange(11), torch.arange(6)])
    input_ids = torch.randint(0, model.args.vocab_size, (17,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model.logits(model.forward_packed(input_ids, positions))
    modules.to_batch_invariant(model)
    assert list(model.state_dict()) == names
    assert model.lm_head.weight is embedding is model.model.embed_tokens.weight  # still tied
    swapped = [m for m in model.modules() if type(m) in modules.SWAPS]
    assert swapped == [], [type(m).__name__ for m in swapped]  # nothing plain left
    assert all(type(m) is modules.InvariantLinear for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        converted = model.logits(model.forward_packed(input_ids, positions))
    torch.testing.assert_close(converted, plain, rtol=1e-4, atol=1e-4)  # other summation orders only


def test_an_engines_conversion_freezes_its_linears(tiny_ckpt):
    model = from_pretrained(tiny_ckpt)
    sides(True, "native", "cpu").generator.convert(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is modules.FrozenInvariantLinear for m in linears)
    assert type(model.model.norm) is modules.InvariantRMSNorm and isinstance(model.model.norm, RMSNorm)
    assert type(model.log_softmax) is modules.InvariantLogSoftmax and isinstance(model.log_softmax, LogSoftmax)


def test_each_side_runs_the_kernels_of_its_mode(tiny_ckpt):
    for engine in ("native", "vllm"):
        default = sides(False, engine, "cpu")
        assert default.trainer.convert is None and not default.trainer.eager
        assert default.generator in (NativeEngineSide(None, None, None), VLLMSide({}, None, None))
    native = sides(True, "native", "cpu")
    assert native.trainer.eager and native.trainer.attention.__self__ is BatchInvariantAttention
    assert native.generator.attention is BatchInvariantPagedAttention
    assert native.generator.kv_cache_dtype == torch.float32  # the CPU kernel reads fp32
    assert sides(True, "native", "cuda").generator.kv_cache_dtype is None  # the model's dtype
    vllm_trainer = sides(True, "vllm", "cpu").trainer
    assert vllm_trainer.eager and vllm_trainer.attention.__self__ is PagedFlashAttention
    model = from_pretrained(tiny_ckpt)
    vllm_trainer.convert(model)  # the sampled token's logprob from vLLM's own kernel
    assert type(model.log_softmax) is VLLMLogSoftmax and type(model.lm_head) is modules.InvariantLinear
    assert vllm_trainer.before_process_group is None  # gloo: no NCCL settings to share
    assert sides(True, "vllm", "cuda").trainer.before_process_group is share_replica_nccl_settings
    assert all(sides(mode, "native", "cuda").trainer.before_process_group is None for mode in (False, True))
    vllm = sides(True, "vllm", "cuda").generator
    assert vllm.environment == {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    with pytest.raises(ValueError, match="generator engine must be one of"):
        sides(True, "sglang", "cpu")


@pytest.mark.parametrize("log_softmax", [modules.InvariantLogSoftmax, VLLMLogSoftmax])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_true_on_policy_head_values_come_from_the_generators_kernels_bit_for_bit(log_softmax, dtype, monkeypatch):
    """The trainer's head (``at_targets``) in true on-policy mode: the targets' log-probabilities
    are the generator's kernel's (batch-invariant ``ops.log_softmax``, or vLLM's per-row one), and
    the logsumexp and entropy derive from them and from ``ops.log_softmax`` eagerly, not from the
    plain class's fused kernels."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, 500, generator=gen)).to(dtype)
    targets = torch.randint(0, 500, (9,), generator=gen)
    full = modules.ops.log_softmax(logits)
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    if log_softmax is VLLMLogSoftmax:  # vLLM's kernel, stood in for by a value the others cannot give
        expected = expected + 1
        monkeypatch.setattr("rlactors.on_policy.vllm_model.vllm_token_logprobs", lambda *_: expected)
    module = LogSoftmax()
    modules.to_batch_invariant(module, log_softmax=log_softmax)
    logprobs, logsumexp, entropy = module.at_targets(logits, targets, with_entropy=True)
    assert torch.equal(logprobs, expected)
    assert torch.equal(logsumexp, logits.gather(-1, targets[:, None]).squeeze(-1) - expected)
    assert torch.equal(entropy, -(full.exp() * full).sum(-1))
    assert module.at_targets(logits, targets)[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_true_on_policy_logit_gradients_are_the_plain_ones_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, 500, generator=gen)).to(dtype)
    targets = torch.randint(0, 500, (9,), generator=gen)
    grad = torch.randn(9, generator=gen)
    logsumexp = logits.float().logsumexp(-1)
    expected = LogSoftmax().grad_logits(logits, logsumexp, targets, grad)
    assert torch.equal(modules.InvariantLogSoftmax().grad_logits(logits.clone(), logsumexp, targets, grad), expected)
