"""Weight sync through the trainer's buffer mapped by CUDA IPC, on one GPU: a true on-policy vLLM
replica colocated on the trainer's GPU takes "shared" by "auto", and its logprobs equal the
trainer's on every step, so every push reached its model whole. Async without sleep (the GPU
demo's setting: the trainer packs the next version only once the replica loaded the last), and
sync with `generator.sleep` (wake the weights, sync, wake the KV cache)."""

from __future__ import annotations

import asyncio

import pytest
from support.vllm_checks import NEEDS_VLLM_GPU, vllm_run_config

from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.run.controller import Controller

pytestmark = NEEDS_VLLM_GPU


@pytest.mark.parametrize("turns", [("controller.mode=async",), ("controller.mode=sync", "generator.sleep=true")],
                         ids=["async", "sleep"])
def test_a_colocated_true_on_policy_replica_loads_every_shared_push_bitwise(tmp_path, turns):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="small", seed=0, dtype="bfloat16")
    config = vllm_run_config(ckpt, tmp_path / "run", "controller.colocate=true", "model.true_on_policy=true",
                             "controller.steps=4", *turns)
    assert config.generator.weight_sync == "shared"
    history = asyncio.run(asyncio.wait_for(Controller(config).run(), 480))
    assert [m["policy/version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    assert [m["loss/logprob_diff/max"] for m in history] == [0.0] * 4, history
    assert all(m["weight_sync/bytes"] > 0 and m["weight_sync/replica_load_s"] > 0 for m in history), history
