"""True on-policy with vLLM: every logprob vLLM samples with equals the trainer's, bit for bit.

vLLM runs our model (rlactors.on_policy.vllm_model) in true on-policy mode with prefix caching and
CUDA graphs; the scenarios run in one engine in a process of its own (tests/support/vllm_scenarios.py). The
trainer core (true_on_policy, vLLM's kernels) then scores every generated token, packed in rows of
two sizes. Two models: the Qwen3-0.6B shape (random bf16 weights) with chunked prefill (a
512-token step budget against prompts of 16-1024 tokens), and the GPU demo's checkpoint (fp32 on
disk, head_dim 32) with the demo config's engine settings (configs/alphabet_sort_1gpu.toml: 512
sequences, 8192 tokens a step). Needs CUDA and vLLM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.trainer_inputs import one_rank_process_group
from support.true_on_policy import trainer_and_generator_logprobs
from support.vllm_checks import NEEDS_VLLM_GPU, attention_of_last_queries, scenario_episode

from rlactors.attention.varlen import VarlenAttention
from rlactors.config import ModelConfig, TrainerConfig
from rlactors.models.checkpoint import fuse_experts, load_args, load_state_dict, save_pretrained
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.on_policy.sides import sides
from rlactors.on_policy.vllm_model import PagedFlashAttention
from rlactors.trainer.core import PolicyTrainerCore

pytestmark = NEEDS_VLLM_GPU

SCENARIOS = Path(__file__).resolve().parents[1] / "support" / "vllm_scenarios.py"
DEMO_CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "alphabet_sort" / "warm_checkpoint_gpu"
# model -> the engine's max_num_seqs and max_num_tokens
ENGINE_SETTINGS = {"0.6b": (256, 512), "demo": (512, 8192), "moe": (256, 512)}


@pytest.fixture(scope="module", params=sorted(ENGINE_SETTINGS))
def checkpoints(request, tmp_path_factory):
    """The model (the Qwen3-0.6B shape with random weights, the demo's, or a small Qwen3-MoE with
    random weights), and the same weights moved a little (the update)."""
    if request.param == "demo":
        ckpt = DEMO_CHECKPOINT
    elif request.param == "moe":
        ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), size="small", seed=0, dtype="bfloat16",
                                    tie_word_embeddings=False, family="qwen3_moe")
    else:
        ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), size="0.6b", seed=0, dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    moved = {name: (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=g))).to(torch.bfloat16)
             for name, t in load_state_dict(ckpt, "cpu").items()}
    updated = tmp_path_factory.mktemp("updated")
    save_pretrained(fuse_experts(moved, load_args(ckpt)), load_args(ckpt), updated)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (updated / name).write_bytes((ckpt / name).read_bytes())
    return request.param, ckpt, updated


@pytest.fixture(scope="module")
def scenarios(checkpoints, tmp_path_factory):
    model, ckpt, updated = checkpoints
    out = tmp_path_factory.mktemp("out") / "scenarios.json"
    settings = [str(n) for n in ENGINE_SETTINGS[model]]
    done = subprocess.run([sys.executable, str(SCENARIOS), str(ckpt), str(updated), str(out),
                           *settings], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def assert_bitwise(core, completions: list[dict], name: str) -> None:
    expected = sum(len(c["tokens"]) for c in completions)
    episodes = [scenario_episode(c) for c in completions]
    for row_tokens in (2048, 8192):  # the same tokens packed two ways
        trainer, generator = trainer_and_generator_logprobs(core, episodes, row_tokens)
        assert trainer.numel() == expected, name
        mismatched = int((trainer != generator).sum())
        assert mismatched == 0, (f"{name}, rows of {row_tokens}: {mismatched} of {expected} logprobs differ, "
                                 f"max {(trainer - generator).abs().max():.3g}")


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_a_token_attends_alike_in_a_decode_step_a_prefill_chunk_and_a_whole_prefill(head_dim):
    """FlashAttention runs a step of single decode tokens without the causal mask, which at head dims
    up to 64 changes how it blocks the keys; heads that small run padded (`attention_head_dim`)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    length = 300
    q = torch.randn(length, 4, head_dim, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(length, 2, head_dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    whole = PagedFlashAttention.from_positions(torch.arange(length, device="cuda")).forward_values(q, k, v)
    assert whole.shape == q.shape
    for t in range(0, length, 13):
        decoded = attention_of_last_queries(t + 1, 1).forward_values(q[t:t + 1], k[:t + 1], v[:t + 1])
        assert torch.equal(decoded[0], whole[t]), t
    chunk = attention_of_last_queries(length, 100).forward_values(q[-100:], k, v)
    assert torch.equal(chunk, whole[-100:])


@pytest.mark.parametrize("head_dim", [32, 128])
def test_trainer_attention_gradients_are_the_attentions_gradients(head_dim):
    """The trainer's attention backward (FlashAttention's, from vLLM's forward output and logsumexp)
    is as close to fp32 attention's gradients as the default attention's are: bf16 rounding only."""
    g = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (300, 17, 700, 1)]).cuda()
    q = torch.randn(positions.numel(), 8, head_dim, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(positions.numel(), 2, head_dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    upstream = torch.randn(q.shape, device="cuda", generator=g).bfloat16()

    def gradients(attention, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention(0, *inputs), inputs, upstream.to(dtype))

    exact = gradients(VarlenAttention.from_positions(positions, backend="sdpa"), torch.float32)
    default = gradients(VarlenAttention.from_positions(positions), torch.bfloat16)
    ours = gradients(PagedFlashAttention.from_positions(positions), torch.bfloat16)
    for name, mine, theirs, truth in zip("qkv", ours, default, exact):
        error, default_error = relative_error(mine.float(), truth), relative_error(theirs.float(), truth)
        assert error < 1.5 * default_error + 1e-3, (name, error, default_error)


def test_trainer_logprobs_equal_vllm_logprobs_bit_for_bit(checkpoints, scenarios):
    _, ckpt, updated = checkpoints
    assert len(scenarios["t1"]) == 256 and len(scenarios["among_256"]) == 256
    prompt_lengths = [len(c["prompt"]) for c in scenarios["t1"].values()]
    assert min(prompt_lengths) < 64 and max(prompt_lengths) > 900  # chunked where the budget is 512 tokens
    reasons = [c["finish_reason"] for c in scenarios["stops"].values()]
    assert len(reasons) == 512 and 0 < reasons.count("stop") < 512
    mine_alone, mine_among = scenarios["alone"]["mine"], scenarios["among_256"]["mine"]
    assert mine_alone["tokens"] == mine_among["tokens"] and mine_alone["logprobs"] == mine_among["logprobs"]
    with one_rank_process_group("cuda") as device:
        core = PolicyTrainerCore(ModelConfig(path=str(ckpt), dtype="bfloat16", true_on_policy=True),
                                 TrainerConfig(ranks=1), device, sides(True, "vllm", device).trainer)
        for name in ("t1", "t07", "alone", "among_256", "turn2", "stops"):
            assert_bitwise(core, list(scenarios[name].values()), name)
        del core
        assert all(c["versions"] == [1] * len(c["tokens"]) for c in scenarios["updated"].values())
        core = PolicyTrainerCore(ModelConfig(path=str(updated), dtype="bfloat16", true_on_policy=True),
                                 TrainerConfig(ranks=1), device, sides(True, "vllm", device).trainer)
        assert_bitwise(core, list(scenarios["updated"].values()), "updated")
