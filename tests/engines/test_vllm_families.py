"""vLLM serves every model family from rlactors' checkpoints, and weight sync loads into it by the
copy plan. Per family (Qwen3; Qwen2 with q/k/v biases and an untied head; Llama 3 with its RoPE
scaling; Qwen3-MoE, served by vLLM's own FusedMoE, its experts synced in the trainer's fused
layout, each sampled token's routed experts returned): vLLM's raw logprobs of its own completions
match our fp32 model's; the broadcast path's load (`rlactors.weight_sync.broadcast.worker_load_staged`)
of a received buffer first goes through vLLM's `load_weights` and proves a copy plan, and the next
weights, copied by that plan, serve the logprobs of our model with those weights; a load while requests
run tags each of their tokens with the version that sampled it. Skipped without CUDA and vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.vllm_checks import LOGPROB_ATOL, NEEDS_VLLM_GPU, max_logprob_error, prompts, run

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.models.checkpoint import from_pretrained, fuse_experts, load_args, load_state_dict
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.types import SamplingParams
from rlactors.weight_sync.packed import PackedLayout

pytestmark = NEEDS_VLLM_GPU

CONFIG = GeneratorConfig(engine="vllm", replicas=1, max_num_seqs=32, max_num_tokens=2048, max_model_len=512,
                         gpu_memory_utilization=0.3, update_mode="hot_swap")


def generate(engine, batch: list[list[int]]) -> list:
    sampling = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(len(batch))]
    done = run(engine, {f"r{i}": (p, sampling[i]) for i, p in enumerate(batch)})
    return [done[f"r{i}"] for i in range(len(batch))]


def ckpt_logprob_error(ckpt, completions) -> float:
    return max_logprob_error(from_pretrained(ckpt, dtype="float32", device="cuda"), completions)


def _receive_into(worker, layout: PackedLayout, buffer: torch.Tensor) -> None:
    """What joining the weight group leaves on a vLLM worker, without the NCCL group: the layout
    and the receive buffer that `worker_load_staged` loads from."""
    worker.rlactors_receiver = SimpleNamespace(layout=layout, buffer=buffer)


@pytest.mark.parametrize("family, tie", [("qwen3", True), ("qwen2", False), ("llama", True), ("qwen3_moe", False)])
def test_vllm_serves_each_family_and_loads_weights_by_the_copy_plan(family, tie, tmp_path):
    from rlactors.engines.vllm_engine import VLLMEngine

    ckpts = [make_tiny_checkpoint(tmp_path / f"seed{seed}", size="small", seed=seed, dtype="bfloat16",
                                  tie_word_embeddings=tie, family=family) for seed in range(3)]
    engine = VLLMEngine.from_config(CONFIG, ModelConfig(path=str(ckpts[0]), dtype="bfloat16"))
    try:
        batch = prompts(16)
        first = generate(engine, batch)
        assert ckpt_logprob_error(ckpts[0], first) < LOGPROB_ATOL
        args = load_args(ckpts[0])
        if args.moe is None:
            assert all(c.routed_experts is None for c in first)
        else:  # vLLM's experts for each sampled token, per sparse layer
            sparse_layers = sum(map(args.is_sparse_layer, range(args.num_hidden_layers)))
            for c in first:
                experts = torch.tensor(c.routed_experts)
                assert experts.shape == (len(c.token_ids), sparse_layers, args.moe.num_experts_per_tok)
                assert 0 <= experts.min() and experts.max() < args.moe.num_experts

        # What the trainer sends: the model's parameters (a tied head only as the embedding; experts
        # fused, as FusedMoE holds them).
        weights = [fuse_experts(load_state_dict(ckpt), load_args(ckpt)) for ckpt in ckpts[1:]]
        assert ("lm_head.weight" in weights[0]) == (not tie)
        layout = PackedLayout.of(weights[0])
        buffer = layout.pack(weights[0], layout.empty("cuda").zero_())
        engine.engine.collective_rpc(_receive_into, args=(layout, buffer))
        assert engine.broadcast_receiver().load(1)["copy_plan"] == 0.0  # vLLM's load_weights, which proves the plan
        after_first = generate(engine, batch)
        assert all(set(c.versions) == {1} for c in after_first)
        assert ckpt_logprob_error(ckpts[1], after_first) < LOGPROB_ATOL

        layout.pack(weights[1], buffer)  # the next version arrives in the same buffer
        assert engine.broadcast_receiver().load(2)["copy_plan"] == 1.0  # copied by the plan
        after_second = generate(engine, batch)
        assert all(set(c.versions) == {2} for c in after_second)
        assert ckpt_logprob_error(ckpts[2], after_second) < LOGPROB_ATOL
        assert any(a.token_ids != b.token_ids for a, b in zip(after_first, after_second))

        # A load while requests run (hot swap): each request's tokens before it carry version 2,
        # those after it version 3, and a MoE's routed experts still cover every token.
        sampling = SamplingParams(max_tokens=48, temperature=1.0, seed=7)
        for i, p in enumerate(batch):
            engine.add_request(f"h{i}", p, sampling)
        done = {}
        while any(len(engine.sampled(f"h{i}").token_ids) < 8 for i in range(len(batch))):
            done.update({c.request_id: c for c in engine.step()})
        layout.pack(weights[0], buffer)
        engine.broadcast_receiver().load(3)
        while engine.has_unfinished():
            done.update({c.request_id: c for c in engine.step()})
        for c in done.values():
            assert len(c.token_ids) == 48 and c.versions == sorted(c.versions), c.request_id
            assert c.versions.count(2) >= 8 and c.versions[-1] == 3, c.versions
            if args.moe is not None:
                assert torch.tensor(c.routed_experts).shape == (48, sparse_layers, args.moe.num_experts_per_tok)
    finally:
        engine.close()
