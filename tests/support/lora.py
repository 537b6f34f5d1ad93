"""LoRA test helpers: PEFT adapters over HF transformers' models, and the true on-policy check of
the native engine with adapters against the trainer core."""

from __future__ import annotations

import torch

from rlactors.config import LoraConfig, LossConfig
from rlactors.lora.adapters import adapter_parameters
from rlactors.trainer.losses import LossNorm
from rlactors.types import SamplingParams
from support.trainer_inputs import rows
from support.true_on_policy import episode, generate, make_core, prompts, requests_with, trainer_and_generator_logprobs

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEARS = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def peft_adapter(ckpt, out_dir, targets, rank=4, alpha=8.0, seed=0):
    """A PEFT LoRA model over HF's model of `ckpt`, lora_B random (PEFT starts it at 0, which
    would test nothing), saved to `out_dir`; returns it."""
    import peft

    model = peft.get_peft_model(hf_model(ckpt), peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(out_dir))
    return model.eval()


def assert_lora_true_on_policy_diff_is_zero(ckpt, device, adapter_dir, dtype: str = "float32") -> None:
    """True on-policy with a random-B PEFT adapter (rank 4, every linear) in the native engine on
    `device` in `dtype`: the trainer core's logprobs of 9 requests' tokens equal the generator's
    bit for bit, the adapters change them, and backward reaches the adapters only."""
    peft_adapter(ckpt, adapter_dir, ALL_LINEARS, rank=4, alpha=8.0)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=ALL_LINEARS, init_from=str(adapter_dir))
    mine = (prompts(1, seed=7)[0], SamplingParams(max_tokens=24, temperature=1.0, seed=3))
    batched = generate(ckpt, True, requests_with(mine, 8, seed=8), max_num_tokens=96, device=device, dtype=dtype,
                       lora=config)
    core = make_core(ckpt, device, true_on_policy=True, dtype=dtype, lora=config)
    episodes = [episode(c) for c in batched.values()]
    trainer, generator = trainer_and_generator_logprobs(core, episodes, row_tokens=256)
    assert trainer.numel() == sum(len(c.token_ids) for c in batched.values()) > 50
    assert torch.equal(trainer, generator), (trainer - generator).abs().max()
    plain = generate(ckpt, True, {"mine": mine}, device=device, dtype=dtype)["mine"]
    assert plain.logprobs != batched["mine"].logprobs  # the adapters are in the generator's forward
    # Backward goes through the merge: the adapters get gradients, the base none.
    batches = rows(1, count=1)
    loss = LossConfig(name="dapo", clip_high=0.28)
    core.forward_backward(batches, LossNorm.for_step(batches, loss.name, max_tokens=40), loss)
    adapters = adapter_parameters(core.model)
    for name, p in core.model.named_parameters():
        assert (p.grad is not None and bool(p.grad.abs().sum() > 0)) == (name in adapters), name
