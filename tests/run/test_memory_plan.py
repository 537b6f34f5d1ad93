"""The memory plan (rlactors.run.memory_plan): its arithmetic against figures computed by hand, the
decoder's saved bytes against what autograd really keeps, and a run that cannot fit refused in
one line, by `--plan` and before the controller spawns anything."""

import asyncio
import dataclasses
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from monarch.actor import ActorError

from rlactors import train
from rlactors.config import LORA_TARGETS, ConfigError, LoraConfig, load_config
from rlactors.lora.adapters import to_lora
from rlactors.models.checkpoint import checkpoint_shapes, load_args
from rlactors.models.decoder import DecoderLayer
from rlactors.models.tiny import make_tiny_checkpoint, size_args
from rlactors.run.controller import Controller
from rlactors.run.memory_plan import (
    GIB,
    generator_memory,
    gpu_gib,
    out_of_memory,
    plan,
    saved_bytes_per_token_layer,
    sync_memory,
    vllm_kv_cache_bytes,
)

V = 151936  # Qwen3's vocabulary
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """config.json and tokenizer (no weights) of the 4B and 8B shapes."""
    root = tmp_path_factory.mktemp("shapes")
    return {size: make_tiny_checkpoint(root / size, size=size, weights=False) for size in ("4b", "8b")}


def cuda_config(path, *overrides, gpus=1):
    return load_config(None, [f'model.path="{path}"', 'model.dtype="bfloat16"', 'controller.device="cuda"',
                              'generator.engine="vllm"',
                              *overrides], available_gpus=gpus)


class _FlashLike(torch.autograd.Function):
    """What a FlashAttention kernel keeps for backward: q, k, v, the output and an fp32 logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros_like(q)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[1], q.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_saved_bytes_per_token_layer_are_what_autograd_keeps(family):
    args = size_args("small", 1000, family=family)
    layer = DecoderLayer(args, 0).to(torch.bfloat16)
    assert kept_bytes(layer, args, tokens=16) == 16 * saved_bytes_per_token_layer(args)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj"), ("gate_proj",)])
def test_saved_bytes_per_token_layer_under_lora_are_what_autograd_keeps(family, targets):
    # The trainer's LoRA layer under mixed precision: a frozen bf16 base, the adapters cast to bf16.
    args = size_args("small", 1000, family=family)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([DecoderLayer(args, 0)])
    lora = LoraConfig(rank=4, target_modules=targets)
    to_lora(holder, lora, torch.bfloat16)
    layer = holder.layers[0].to(torch.bfloat16)
    assert kept_bytes(layer, args, tokens=16) == 16 * saved_bytes_per_token_layer(args, 2, lora)


def kept_bytes(layer, args, tokens):
    """The bytes autograd saves for backward in `layer`'s forward of `tokens` bf16 tokens."""
    x = torch.randn(tokens, args.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(2, tokens, args.head_dim, dtype=torch.bfloat16)
    # Parameters and RoPE's tables (one per forward, not per layer) are not activations.
    shared = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in shared:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos[:, None].squeeze(1), sin, lambda i, q, k, v: _FlashLike.apply(q, k, v))
    return sum(kept.values())


def test_plan_of_4b_on_one_gpu_colocated_with_sleep_and_offload(shapes):
    c = cuda_config(shapes["4b"], "generator.weight_sync=messages",
                    "trainer.ranks=1", "trainer.offload_optimizer=true", "generator.replicas=1",
                    "generator.gpu_memory_utilization=0.3", "generator.max_model_len=8192", "generator.sleep=true",
                    "controller.colocate=true", 'controller.mode="sync"', "batcher.row_tokens=8192",
                    "batcher.rows_per_microbatch=1")
    p = plan(c, load_args(c.model.path), gpu_gib=80)
    # By hand. Qwen3-4B: hidden 2560, intermediate 9728, 36 layers, 32 q / 8 kv heads of 128, tied.
    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560
    root = V * 2560 + 2560  # embedding (the head is tied) and final norm
    params = 36 * layer + root
    assert (layer, params) == (100_930_816, 4_022_468_096)
    t = p.trainer
    assert t.master_weights == t.gradients == 4 * params
    assert t.optimizer == 8 * V * 2560  # offloaded: the largest group's moments (the embedding)
    assert t.optimizer_resident == 0
    assert t.compute_copies == 2 * (root + 2 * layer)  # bf16 root and two layers
    # Eager bytes per token and layer: 2 norms (fp32 copy, bf16 normalized and output, rsqrt),
    # q/k norms (fp32 copy, bf16 normalized, rsqrt per head), attention (q, k, v, out, lse), MLP.
    eager = 2 * (8 * 2560 + 4) + (6 * (4096 + 1024) + 4 * 40) + (2 * (2 * 4096 + 2 * 1024) + 4 * 32) + 8 * 9728
    assert eager == 170_280
    assert t.activations == pytest.approx(8192 * 36 * eager * 0.72)  # compiled layers keep 72% of it
    # The compiled head's chunk: its bf16 logits and their bf16 gradient, 4 bytes a vocabulary entry.
    assert t.logprob_head == 8192 * (2 * 2560 + 12) + 1024 * V * 4
    # By messages (colocated): rank 0 gathers the bf16 policy a 512 MiB chunk at a time, and keeps nothing.
    assert (t.sync_buffer, t.sync_gather) == (0, 512 * 2**20)
    peak = 4 * params * 2 + 8 * V * 2560 + 2 * (root + 2 * layer) + 8192 * 36 * eager * 0.72 + t.logprob_head + GIB
    assert t.peak == pytest.approx(peak)
    g = p.generator
    share = 0.3 * 80 * GIB
    beyond = 2 * GIB  # context and pools; asleep in turns, its KV cache is the plan's (no overshoot)
    assert g.weights == 2 * params and g.beyond == beyond and g.share == share + beyond and g.asleep == 2 * GIB
    assert g.kv_tokens == int((share - 2 * params - 2 * GIB) // (2 * 36 * 8 * 128 * 2))
    assert vllm_kv_cache_bytes(c, p.args, 80 * GIB) == int(share - 2 * params - 2 * GIB) == g.kv_cache
    phases = p.phases()
    assert phases["training"] == (pytest.approx(peak), 2 * GIB)
    assert phases["syncing"] == (4 * params + GIB + GIB / 2, 2 * GIB + 2 * params)
    assert phases["generation"] == (4 * params + GIB, share + beyond)
    assert sum(phases["training"]) / GIB == pytest.approx(71.3, abs=0.05)
    assert p.largest_share() == math.floor(100 * (80 * GIB - 4 * params - GIB - beyond) / (80 * GIB)) / 100 == 0.77
    assert p.host_bytes == 8 * params + 2 * params  # the offloaded moments, vLLM's weights asleep
    assert p.problems() == []


def test_plan_of_8b_on_two_trainer_gpus_apart_from_the_generators(shapes):
    c = cuda_config(shapes["8b"], "trainer.ranks=2", "trainer.activation_checkpointing=true",
                    "trainer.compile_layers=false", "generator.replicas=2", "generator.gpu_memory_utilization=0.85",
                    "batcher.row_tokens=16384", "batcher.rows_per_microbatch=1", gpus=4)
    p = plan(c, load_args(c.model.path), gpu_gib=96)
    # By hand. Qwen3-8B: hidden 4096, intermediate 12288, 36 layers, 32 q / 8 kv heads, untied.
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    root = 2 * V * 4096 + 4096  # embedding, LM head, final norm
    params = 36 * layer + root
    assert params == 8_190_735_360
    t = p.trainer
    assert t.master_weights == t.gradients == 4 * params / 2
    assert t.optimizer == t.optimizer_resident == 8 * params / 2
    assert (t.sync_buffer, t.sync_gather) == (2 * params, 0)  # GPUs apart: the broadcast's packed buffer on rank 0
    eager = 2 * (8 * 4096 + 4) + (6 * (4096 + 1024) + 4 * 40) + (2 * (2 * 4096 + 2 * 1024) + 4 * 32) + 8 * 12288
    # Checkpointing: each layer's bf16 input kept, one layer's activations (eager: not compiled).
    assert t.activations == 16384 * (36 * 2 * 4096 + eager)
    peak = (16 * params / 2 + 2 * (root + 2 * layer) + t.activations + 16384 * (2 * 4096 + 12) + 1024 * V * 14
            + 2 * params + GIB)
    assert t.peak == pytest.approx(peak)
    vllm = 0.85 * 96 * GIB + 2 * GIB + 14 * 36 * 4096**2
    assert p.generator.share == vllm
    assert p.phases() == {"trainer GPUs": (pytest.approx(peak), 0.0), "generator GPUs": (0.0, vllm)}
    assert peak / GIB == pytest.approx(90.3, abs=0.05)
    assert p.problems() == []


@pytest.mark.parametrize("overrides, chunk_bytes", [
    ([], 4),  # compiled: the chunk's bf16 logits and their bf16 gradient
    (["trainer.compile_layers=false"], 14),  # eager: bf16 logits and three fp32 [chunk, vocab] tensors
    (["model.true_on_policy=true"], 14),  # its kernels run eager
    (['controller.device="cpu"', 'generator.engine="native"'], 14),  # compiled on CUDA only
])
def test_the_lm_heads_chunk_is_the_compiled_heads_only_where_the_trainer_compiles(shapes, overrides, chunk_bytes):
    c = cuda_config(shapes["4b"], "trainer.ranks=1", "generator.replicas=1", "batcher.row_tokens=8192",
                    "batcher.rows_per_microbatch=1", "loss.kl_coef=0.1", *overrides, gpus=2)
    t = plan(c, load_args(c.model.path)).trainer
    # Per token the final bf16 hidden states and fp32 logprob, logsumexp and entropy; one chunk of 1024.
    assert t.logprob_head == 8192 * (2 * 2560 + 12) + 1024 * V * chunk_bytes
    # The reference's forward is never compiled: its chunk is the eager head's in every mode.
    assert t.reference_forward == 8192 * qwen3_eager_bytes(2560, 9728, 32, 8) + 8192 * (2 * 2560 + 4) + 1024 * V * 14


def test_the_32b_config_fits_eight_80gb_gpus(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "32b", size="32b", weights=False)
    c = load_config(ROOT / "configs" / "qwen3_32b_8gpu.toml", [f'model.path="{checkpoint}"'], available_gpus=8)
    p = plan(c, load_args(checkpoint), gpu_gib(c))
    assert p.gpu_bytes == 79.6 * GIB
    phases = {name: round(sum(bytes) / GIB, 1) for name, bytes in p.phases().items()}
    assert phases == {"training": 53.9, "syncing": 49.8, "generation": 62.0} and p.problems() == []
    # The sync by messages stages a 512 MiB chunk on rank 0's GPU, and gathers every rank's slot of it.
    assert p.trainer.sync_gather == 512 * 2**20 * (2 + 1 / 8)
    assert p.largest_share() == 0.77 and p.config.generator.gpu_memory_utilization == 0.55


def test_a_run_that_cannot_fit_fails_in_one_line_naming_the_keys(shapes):
    # The GPU demo's config at the 4B shape: trainer and vLLM resident together on an H200.
    c = cuda_config(shapes["4b"], "generator.weight_sync=messages",
                    "trainer.ranks=1", "generator.replicas=1", "generator.gpu_memory_utilization=0.3",
                    "controller.colocate=true", "batcher.row_tokens=16384", "batcher.rows_per_microbatch=1")
    with pytest.raises(ConfigError) as error:
        plan(c, load_args(c.model.path), gpu_gib=139.8).check()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("memory plan: 177.1 GiB needed per GPU of 139.8 (both: trainer 130.0 + vllm 47.0): set "
                              "trainer.offload_optimizer = true, generator.sleep = true, "
                              "trainer.activation_checkpointing = true, lower generator.gpu_memory_utilization")
    # vLLM's share too small for one sequence of max_model_len
    c = cuda_config(shapes["8b"], "trainer.ranks=1", "generator.replicas=1", "generator.gpu_memory_utilization=0.2",
                    "generator.max_model_len=16384", "rollout.max_total_tokens=16384", gpus=2)
    with pytest.raises(ConfigError, match=r"^memory plan: 163\.2 GiB needed per GPU of 80\.0 \(trainer GPUs: trainer "
                                          r"163\.2 \+ vllm 0\.0\): set .*; vLLM's share \(16\.0 GiB\) leaves KV cache "
                                          r"for 0 tokens after its weights \(15\.3 GiB\), fewer than "
                                          r"generator\.max_model_len = 16384: raise "
                                          r"generator\.gpu_memory_utilization or generator\.tp$"):
        plan(c, load_args(c.model.path), gpu_gib=80).check()


def test_plan_command_prints_the_table_and_refuses_what_cannot_fit(shapes, capsys):
    base = ["--plan", f'model.path="{shapes["4b"]}"', 'model.dtype="bfloat16"', 'controller.device="cuda"',
            'generator.engine="vllm"', "generator.weight_sync=messages",
                    "trainer.ranks=1", "generator.replicas=1",
            "generator.gpu_memory_utilization=0.3", "controller.colocate=true", "controller.gpu_memory_gib=139.8",
            "batcher.row_tokens=16384", "batcher.rows_per_microbatch=1"]
    assert train.main([*base, "generator.sleep=true", "trainer.offload_optimizer=true"]) == 0
    out = capsys.readouterr().out
    assert "trainer: step peak" in out and "GPU in phase 'generation'" in out
    # the fullest phase with sleep and offload: training, the trainer's step beside vLLM asleep
    fitting = load_config(None, [*base[1:], "generator.sleep=true", "trainer.offload_optimizer=true"], available_gpus=1)
    name, trainer, generator = plan(fitting, load_args(shapes["4b"]), 139.8).needed
    assert name == "training" and generator == 2 * GIB
    spare = (139.8 * GIB - trainer - generator) / GIB
    assert out.rstrip().endswith(f"GPU of 139.8 GiB: fits, {spare:.1f} GiB spare in phase 'training' (the plan counts "
                                 "tensors, not what the allocators keep besides: keep some spare)")
    assert train.main(base) == 2
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: memory plan: 177.1 GiB needed per GPU")


def write_sparse_weights(checkpoint):
    """A model.safetensors whose header names every tensor of the shape and whose data is a hole
    in a sparse file: the checks of a checkpoint read headers only, and the disk holds none of it."""
    header, offset = {}, 0
    for name, shape in checkpoint_shapes(load_args(checkpoint)).items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with (checkpoint / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)


def test_the_controller_refuses_a_run_that_cannot_fit_before_spawning(shapes, tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "4b", size="4b", weights=False)
    write_sparse_weights(checkpoint)
    c = cuda_config(checkpoint, "trainer.ranks=1", "generator.replicas=1", "controller.colocate=true",
                    "controller.gpu_memory_gib=80", "batcher.row_tokens=16384", "batcher.rows_per_microbatch=1",
                    f'controller.run_dir="{tmp_path / "run"}"')
    controller = Controller(c)
    with pytest.raises(ConfigError, match=r"^memory plan: .* needed per GPU of 80\.0"):
        asyncio.run(controller.start())
    assert controller.trainer is None and controller.router is None


def test_a_share_too_big_beside_the_trainers_resident_memory_is_refused_with_the_largest_that_fits(shapes):
    # The 4B shape fully fine-tuned, colocated in turns on an H200: between steps the trainer keeps
    # fp32 weights and AdamW's moments (12 bytes a parameter) beside vLLM's share.
    c = cuda_config(shapes["4b"], "generator.weight_sync=messages",
                    "trainer.ranks=1", "generator.replicas=1", "generator.gpu_memory_utilization=0.7",
                    "generator.sleep=true", "controller.colocate=true", 'controller.mode="sync"',
                    "trainer.activation_checkpointing=true", "batcher.row_tokens=16384",
                    "batcher.rows_per_microbatch=1")
    p = plan(c, load_args(c.model.path), gpu_gib=139.8)
    resident = 12 * 4_022_468_096 + GIB
    assert p.trainer.resident == resident
    largest = math.floor(100 * (139.8 * GIB - resident - p.generator.beyond) / (139.8 * GIB)) / 100
    assert p.largest_share() == largest == 0.65 and p.largest_share(margin_gib=4) == 0.62
    with pytest.raises(ConfigError) as error:
        p.check()
    assert str(error.value) == (
        "memory plan: 145.8 GiB needed per GPU of 139.8 while vLLM generates: generator.gpu_memory_utilization = 0.7 "
        "(97.9 GiB, 2.0 beyond it) is too big beside the trainer's 46.0 GiB kept between steps: set "
        "generator.gpu_memory_utilization <= 0.65 or trainer.offload_optimizer = true or more trainer.ranks")
    assert plan(dataclasses.replace(c, generator=dataclasses.replace(c.generator, gpu_memory_utilization=0.63)),
                load_args(c.model.path), gpu_gib=139.8).problems() == []


@pytest.mark.parametrize("weight_sync, kept, gathered", [("messages", 0, 512 * 2**20), ("broadcast", 2, 0),
                                                          ("shared", 2, 0)])
def test_the_weight_syncs_buffer_on_trainer_rank_0(shapes, weight_sync, kept, gathered):
    c = cuda_config(shapes["4b"], "trainer.ranks=1", "generator.replicas=1", gpus=2)
    # "shared" (a colocated replica maps rank 0's packed bf16 policy by CUDA IPC) keeps it like broadcast.
    c = dataclasses.replace(c, generator=dataclasses.replace(c.generator, weight_sync=weight_sync))
    params = 4_022_468_096
    assert sync_memory(c, load_args(c.model.path)) == (kept * params, gathered)
    t = plan(c, load_args(c.model.path)).trainer
    assert t.resident == 12 * params + kept * params + GIB and t.sync_gather == gathered


def qwen3_eager_bytes(hidden, intermediate, heads, kv_heads, head_dim=128):
    """Per token, the bf16 eager layer's saved bytes, by the formula in docs/model_sizes.md."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return (2 * (8 * hidden + 4) + (6 * (q + kv) + 4 * (heads + kv_heads)) + (2 * (2 * q + 2 * kv) + 4 * heads)
            + 8 * intermediate)


def plan_of_4b_in_turns_on_80gb(shapes, *overrides):
    """The 4B shape on one 80 GB GPU, colocated with sleep and offload, 8192 tokens a microbatch."""
    c = cuda_config(shapes["4b"], *overrides, "generator.weight_sync=messages", "trainer.ranks=1",
                    "trainer.offload_optimizer=true", "generator.replicas=1", "generator.gpu_memory_utilization=0.3",
                    "generator.max_model_len=8192", "generator.sleep=true", "controller.colocate=true",
                    'controller.mode="sync"', "batcher.row_tokens=8192", "batcher.rows_per_microbatch=1")
    return plan(c, load_args(c.model.path), gpu_gib=80)


def test_an_actor_call_out_of_gpu_memory_is_said_with_the_plans_phase_and_the_keys(shapes):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.66 GiB. GPU 0 has a total capacity of "
                                 "79.25 GiB of which 1.92 GiB is free. Including non-PyTorch memory, this process "
                                 "has 77.3 GiB memory in use.")
    trainer = ActorError(oom, "Actor call policy_trainer.forward_backward failed.")
    said = ("CUDA out of memory. Tried to allocate 2.66 GiB. GPU 0 has a total capacity of 79.25 GiB of which 1.92 GiB "
            "is free")
    assert out_of_memory(trainer) == ("policy_trainer.forward_backward", said)
    # vLLM's sleep-mode allocator waking the KV cache, under the router's call to the replica
    cumem = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"
    engines = ActorError(ActorError(RuntimeError(cumem), "Actor call generator.wake_up failed."),
                         "Actor call router.wake_up failed.")
    assert out_of_memory(engines) == ("router.wake_up", cumem)
    for other in (ValueError("bad"), RuntimeError("DefaultCPUAllocator: can't allocate memory")):
        assert out_of_memory(ActorError(other, "Actor call policy_trainer.forward_backward failed.")) is None

    p = plan_of_4b_in_turns_on_80gb(shapes)  # its training phase by hand: test_plan_of_4b_on_one_gpu_...
    params = 4_022_468_096
    assert p.ran_out_line("policy_trainer.forward_backward", said) == (
        f"policy_trainer.forward_backward ran out of GPU memory ({said}); the memory plan put a GPU at 71.3 GiB of "
        "80.0 (training: trainer 69.3 + vllm 2.0), and it counts tensors, not what the allocators keep besides: set "
        "trainer.activation_checkpointing = true, more trainer.ranks or lower batcher.rows_per_microbatch or "
        "batcher.row_tokens")
    # the engines: the generation phase, the trainer's fp32 weights and context beside vLLM's share and 2 GiB
    assert (4 * params + GIB) / GIB == pytest.approx(15.98, abs=0.005)
    assert p.ran_out_line("router.wake_up", "CUDA Error: out of memory") == (
        "router.wake_up ran out of GPU memory (CUDA Error: out of memory); the memory plan put a GPU at 42.0 GiB of "
        "80.0 (generation: trainer 16.0 + vllm 26.0), and it counts tensors, not what the allocators keep besides: "
        "set lower generator.gpu_memory_utilization or more trainer.ranks")
    # replicas on GPUs of their own: theirs, and the keys of their share
    apart = cuda_config(shapes["8b"], "trainer.ranks=1", "generator.replicas=1", gpus=2)
    line = plan(apart, load_args(apart.model.path), gpu_gib=80).ran_out_line("router.wake_up", "CUDA Error")
    assert re.search(r"put a GPU at [\d.]+ GiB of 80\.0 \(generator GPUs: trainer 0\.0 \+ vllm [\d.]+\), .*: set lower "
                     r"generator\.gpu_memory_utilization or raise generator\.tp$", line), line


def test_the_reference_policy_is_counted_on_each_trainer_rank(shapes):
    p = plan_of_4b_in_turns_on_80gb(shapes, "loss.kl_coef=0.1")
    c = p.config
    without = plan(dataclasses.replace(c, loss=dataclasses.replace(c.loss, kl_coef=0.0)), p.args, gpu_gib=80)
    params, eager = 4_022_468_096, qwen3_eager_bytes(2560, 9728, 32, 8)
    assert eager == 170_280
    t = p.trainer
    assert t.reference == 2 * params  # a frozen bf16 copy, one rank: all of it
    # Its no-grad forward, before the policy's: one layer's intermediates, the final hidden states
    # and logprobs, one chunk of the eager head (never compiled; one rank: nothing gathered).
    assert t.reference_forward == 8192 * eager + 8192 * (2 * 2560 + 4) + 1024 * V * 14
    assert t.reference_logprobs == 4 * 8192  # fp32, kept for the KL term
    policy = t.compute_copies + t.activations + t.logprob_head + 4 * 8192
    assert t.reference_forward < policy  # the policy's backward stays the peak
    assert t.peak == pytest.approx(without.trainer.peak + 2 * params + 4 * 8192)
    assert t.resident == without.trainer.resident + 2 * params == 4 * params + 2 * params + GIB
    assert p.phases()["generation"] == (6 * params + GIB, 0.3 * 80 * GIB + p.generator.beyond)
    assert p.largest_share() == math.floor(100 * (80 * GIB - 6 * params - GIB - p.generator.beyond) / (80 * GIB)) / 100
    assert "trainer: reference policy (loss.kl_coef), bfloat16" in p.table()
    assert without.trainer.reference == without.trainer.reference_forward == 0


def test_the_teacher_is_counted_on_the_trainers_first_gpu(tmp_path):
    student = make_tiny_checkpoint(tmp_path / "0.6b", size="0.6b", weights=False)
    teacher = make_tiny_checkpoint(tmp_path / "1.7b", size="1.7b", weights=False)
    c = cuda_config(student, f'teacher.path="{teacher}"', "generator.weight_sync=messages", "trainer.ranks=1",
                    "generator.replicas=1", "generator.gpu_memory_utilization=0.3", "generator.sleep=true",
                    "controller.colocate=true", 'controller.mode="sync"', "batcher.row_tokens=8192",
                    "batcher.rows_per_microbatch=1")
    p = plan(c, load_args(student), gpu_gib=139.8)
    # By hand. Qwen3-1.7B: hidden 2048, intermediate 6144, 28 layers, 16 q / 8 kv heads of 128, tied.
    layer = 2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 2 * 128 + 3 * 2048 * 6144 + 2 * 2048
    params = 28 * layer + V * 2048 + 2048
    assert params == 1_720_574_976
    eager = qwen3_eager_bytes(2048, 6144, 16, 8)
    assert eager == 112_808
    teacher_bytes = p.teacher
    assert teacher_bytes.weights == 2 * params  # bf16 (model.dtype), one trainer host: all of it
    assert teacher_bytes.scoring == 8192 * eager + 8192 * (2 * 2048 + 4) + 1024 * V * 14
    total = 2 * params + teacher_bytes.scoring + GIB
    assert teacher_bytes.total == total
    t, g = p.trainer, p.generator
    assert p.phases() == {"training": (t.peak + total, g.asleep),
                          "syncing": (t.resident + t.sync_gather + total, g.asleep + g.weights),
                          "generation": (t.resident + total, g.share)}
    assert p.largest_share() == math.floor(100 * (139.8 * GIB - t.resident - total - g.beyond) / (139.8 * GIB)) / 100
    assert "teacher: on trainer rank 0's GPU, in every phase" in p.table()
    assert plan(c, load_args(student)).teacher == teacher_bytes  # its shape read from teacher.path
    with pytest.raises(ConfigError) as error:
        plan(c, load_args(student), gpu_gib=16).check()
    assert str(error.value) == (
        "memory plan: 21.6 GiB needed per GPU of 16.0 while vLLM generates: generator.gpu_memory_utilization = 0.3 "
        "(4.8 GiB, 2.0 beyond it) is too big beside the trainer and teacher's 14.8 GiB kept between steps: set "
        "trainer.offload_optimizer = true or more trainer.ranks; 31.0 GiB needed per GPU of 16.0 (training: trainer "
        "and teacher 29.0 + vllm 2.0): set trainer.offload_optimizer = true, trainer.activation_checkpointing = true, "
        "more trainer.ranks or lower batcher.rows_per_microbatch or batcher.row_tokens")


def test_lora_counts_the_frozen_base_the_adapters_and_the_replicas_base_copy(shapes):
    p = plan_of_4b_in_turns_on_80gb(shapes, "model.lora.rank=16")
    c = p.config
    # By hand, Qwen3-4B with rank 16 on all seven linears: A [r, in] and B [out, r] each.
    q, kv, h, i = 4096, 1024, 2560, 9728
    layer_adapters = 16 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    adapters = 36 * layer_adapters
    assert (layer_adapters, adapters) == (917_504, 33_030_144)
    adapted = 36 * (h * q + 2 * h * kv + q * h + 3 * h * i)  # the adapted linears' base
    layer, root, params = 100_930_816, V * 2560 + 2560, 4_022_468_096
    t = p.trainer
    assert t.master_weights == t.gradients == 4 * adapters  # fp32, the adapters alone
    assert t.optimizer == 8 * layer_adapters and t.optimizer_resident == 0  # offloaded: one layer's
    assert t.frozen_base == 2 * params  # bf16, no master
    assert t.compute_copies == 2 * (root + 2 * (layer + layer_adapters))
    # Frozen norms keep no normalized input (bf16, two of hidden, the q/k norms'); B keeps A's 16
    # outputs per adapted linear and token.
    lora_layer = 170_280 - 2 * (2 * h + q + kv) + 2 * 16 * 7
    assert lora_layer == 150_024
    assert t.activations == pytest.approx(8192 * 36 * lora_layer * 0.72)
    assert (t.sync_buffer, t.sync_gather) == (0, 2 * adapters)  # the bf16 adapters, gathered in one chunk
    assert t.resident == 4 * adapters + 2 * params + GIB
    g = p.generator
    beyond = 2 * GIB + 2 * adapted  # the replica's bf16 copy of the adapted rows (in turns: no overshoot)
    assert g.lora_base == 2 * adapted and g.beyond == beyond and g.share == 0.3 * 80 * GIB + beyond
    assert g.asleep == 2 * GIB + 2 * adapted  # made outside vLLM's pools: it stays while asleep
    assert p.phases()["syncing"] == (t.resident + 2 * adapters, g.asleep + 2 * params)
    table = p.table()
    assert "trainer: LoRA's frozen base, bf16" in table and "trainer: LoRA rank 16 adapters' fp32 gradients" in table
    assert sync_memory(c, p.args) == (0, 2 * adapters)
    # The native engine keeps the same base copy, and its adapters in model.dtype, beside its weights.
    native = generator_memory(dataclasses.replace(c, generator=dataclasses.replace(c.generator, engine="native")),
                              p.args, gpu_bytes=None)
    assert native.lora_base == 2 * (adapted + adapters)
    assert native.share == native.asleep == 2 * params + native.kv_cache + 2 * (adapted + adapters) + GIB


def test_replicas_in_turns_get_the_plans_kv_cache_and_others_size_their_own(shapes):
    from rlactors.run.generation import planned_kv_cache

    turns = ["trainer.ranks=1", "generator.replicas=1", "generator.gpu_memory_utilization=0.3", "generator.sleep=true",
             "controller.colocate=true", 'controller.mode="sync"', "controller.gpu_memory_gib=80"]
    c = cuda_config(shapes["4b"], *turns)
    # the share less the bf16 weights of Qwen3-4B's 4,022,468,096 parameters and 2 GiB of runtime
    assert planned_kv_cache(c) == int(0.3 * 80 * GIB - 2 * 4_022_468_096 - 2 * GIB) == 15_577_383_936
    assert planned_kv_cache(cuda_config(shapes["4b"], *turns[:3], "controller.colocate=true",
                                        "controller.gpu_memory_gib=80")) is None  # awake throughout: vLLM's own
    assert planned_kv_cache(load_config(None, [f'model.path="{shapes["4b"]}"', *turns[:-1]])) is None  # CPU


def test_the_docs_table_of_8b_14b_and_32b_plans_is_what_the_plan_says(tmp_path):
    """docs/model_sizes.md's rows: configs/qwen3_32b_8gpu.toml with the model, the GPU count (a
    trainer rank and a replica of one GPU each, but 32B's own layout) and each row's overrides."""
    doc = (ROOT / "docs" / "model_sizes.md").read_text()
    table = doc[doc.index("| model | GPUs | overrides |"):].split("\n\n")[0].splitlines()[2:]
    checkpoints = {}
    for line in table:
        model, gpus, overrides, *_ = (cell.strip() for cell in line.strip("|").split("|"))
        size = model.removeprefix("Qwen3-").lower()
        if size not in checkpoints:
            checkpoints[size] = make_tiny_checkpoint(tmp_path / size, size=size, weights=False)
        layout = [] if size == "32b" else [f"trainer.ranks={gpus}", f"generator.replicas={gpus}", "generator.tp=1"]
        given = [] if overrides == "(the file as is)" else overrides.split()
        c = load_config(ROOT / "configs" / "qwen3_32b_8gpu.toml",
                        [f'model.path="{checkpoints[size]}"', *layout, *given], available_gpus=8)
        p = plan(c, load_args(checkpoints[size]), gpu_gib(c))
        phases = p.phases()
        spare = p.gpu_bytes - max(sum(phase) for phase in phases.values())
        fits = "no" if p.problems() else "yes" + (f" ({spare / GIB:.1f} GiB spare: tight)" if spare < 4 * GIB else "")
        cells = [model, gpus, overrides, f"{p.trainer.peak / GIB:.1f}", f"{p.trainer.resident / GIB:.1f}",
                 f"{p.generator.share / GIB:.1f}", " / ".join(f"{n} {sum(b) / GIB:.1f}" for n, b in phases.items()),
                 fits, f"{p.largest_share():g}"]
        assert line == "| " + " | ".join(cells) + " |"
    assert len(table) == 13
