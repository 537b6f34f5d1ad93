"""The native engine and the trainer core side by side, for the true on-policy tests: generate
requests in one fresh engine, turn completions into episodes, and score them with the trainer
core packed by the Batcher."""

from __future__ import annotations

import torch

from rlactors.config import BatcherConfig, GeneratorConfig, LoraConfig, ModelConfig, TrainerConfig
from rlactors.engines.native import NativeEngine
from rlactors.models.moe import SparseMoeBlock
from rlactors.on_policy.sides import sides
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.types import Episode, RolloutStatus
from rlactors.trainer.core import PolicyTrainerCore
from rlactors.types import SamplingParams

VOCAB = 1024  # the tiny checkpoint's


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 50, (n,), generator=g)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def generate(ckpt, true_on_policy: bool, requests: dict[str, tuple[list[int], SamplingParams]],
             max_num_tokens: int = 128, device: torch.device | str = "cpu", dtype: str = "float32",
             lora: LoraConfig | None = None) -> dict:
    """Runs the requests to completion in one fresh engine on `device` in `dtype` (chunked
    prefill under a small budget), with `lora`'s adapters if given."""
    generator = GeneratorConfig(max_num_seqs=32, max_num_tokens=max_num_tokens, kv_cache_tokens=4096,
                                block_size=16, max_model_len=512)
    model = ModelConfig(path=str(ckpt), true_on_policy=true_on_policy, dtype=dtype, lora=lora or LoraConfig())
    engine = NativeEngine.from_config(generator, model, device=device)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return done


def episode(completion) -> Episode:
    prompt, tokens = list(completion.prompt_token_ids), list(completion.token_ids)
    return Episode(token_ids=prompt + tokens, loss_mask=[False] * len(prompt) + [True] * len(tokens),
                   generator_logprobs=[0.0] * len(prompt) + list(completion.logprobs),
                   advantages=[0.0] * len(prompt) + [1.0] * len(tokens),
                   versions=[-1] * len(prompt) + [0] * len(tokens),
                   group_id=completion.request_id, rollout_index=0, branch=0, reward=0.0,
                   status=RolloutStatus.COMPLETED)


def trainer_and_generator_logprobs(core: PolicyTrainerCore, episodes: list[Episode],
                                   row_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, generator) logprobs of every generated token, packed by the Batcher into rows of
    `row_tokens`; tokens come out in packing order, so both tensors are sorted by the pair."""
    packed = Batcher(BatcherConfig(row_tokens=row_tokens, rows_per_microbatch=3)).pack(episodes)
    trainer, generator = [], []
    for mb in packed.per_rank[0]:
        logprobs = core.compute_logprobs([mb])
        trainer.append(logprobs[mb.loss_mask])
        generator.append(mb.generator_logprobs[mb.loss_mask])
    return torch.cat(trainer), torch.cat(generator)


def make_core(ckpt, device, true_on_policy: bool, dtype: str = "float32",
              lora: LoraConfig | None = None, **trainer) -> PolicyTrainerCore:
    model = ModelConfig(path=str(ckpt), true_on_policy=true_on_policy, dtype=dtype, lora=lora or LoraConfig())
    return PolicyTrainerCore(model, TrainerConfig(**{"ranks": 1, "logprob_chunk_tokens": 100, **trainer}), device,
                             sides(true_on_policy, "native", device).trainer)


def trainer_experts(core: PolicyTrainerCore, completion) -> list:
    """The experts the trainer core routes each generated token's input position to (the
    position whose logits give that token), the sequence scored alone: [tokens, sparse layers, k]."""
    record = []
    hooks = [module.experts.register_forward_hook(lambda _, inputs, out: record.append(inputs[1]))
             for module in core.model.modules() if isinstance(module, SparseMoeBlock)]
    try:
        ep = episode(completion)
        mb = Batcher(BatcherConfig(row_tokens=len(ep.token_ids), rows_per_microbatch=1)).pack([ep]).per_rank[0][0]
        core.compute_logprobs([mb])
    finally:
        for hook in hooks:
            hook.remove()
    first = len(completion.prompt_token_ids) - 1
    return torch.stack(record, dim=1)[first:first + len(completion.token_ids)].tolist()


def requests_with(mine: tuple[list[int], SamplingParams], others: int, seed: int) -> dict:
    out = {"mine": mine}
    for i, prompt in enumerate(prompts(others, seed)):
        out[f"other{i}"] = (prompt, SamplingParams(max_tokens=4 + 2 * i, temperature=1.0, seed=100 + i))
    return out


def assert_moe_routes_and_scores_as_the_trainer(ckpt, device, dtype: str = "float32") -> None:
    """Qwen3-MoE in true on-policy mode on `device`: a request's tokens, logprobs and the experts
    each token was routed to are bitwise the same alone and among 6 others, and the trainer core
    routes every token to the same experts and computes the same logprobs."""
    mine = (prompts(1, seed=7)[0], SamplingParams(max_tokens=16, temperature=1.0, seed=3))
    alone = generate(ckpt, True, {"mine": mine}, device=device, dtype=dtype)["mine"]
    batched = generate(ckpt, True, requests_with(mine, 6, seed=8), max_num_tokens=64, device=device, dtype=dtype)
    assert (alone.token_ids, alone.logprobs, alone.routed_experts) == (
        batched["mine"].token_ids, batched["mine"].logprobs, batched["mine"].routed_experts)
    assert [len(experts) for experts in alone.routed_experts] == [3] * 16  # 3 sparse layers, every token
    core = make_core(ckpt, device, true_on_policy=True, dtype=dtype)
    assert trainer_experts(core, alone) == alone.routed_experts
    episodes = [episode(c) for c in batched.values()]
    for row_tokens in (80, 1024):
        trainer, generator = trainer_and_generator_logprobs(core, episodes, row_tokens)
        assert trainer.numel() == sum(len(c.token_ids) for c in batched.values())
        assert torch.equal(trainer, generator), (row_tokens, (trainer - generator).abs().max())
