"""vLLM engine on a GPU: generation with raw logprobs, seeds, stops, streamed requests, weight loads
with versions, bad input, and a Router -> Generator(vLLM) replica in Monarch procs. Skipped without
CUDA and vLLM."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from support.linux import running
from support.vllm_checks import LOGPROB_ATOL, NEEDS_VLLM_GPU, max_logprob_error, prompts, run

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.models.checkpoint import from_pretrained
from rlactors.models.tiny import make_tiny_checkpoint
from rlactors.types import SamplingParams

pytestmark = NEEDS_VLLM_GPU

CONFIG = GeneratorConfig(engine="vllm", replicas=1, max_num_seqs=64, max_num_tokens=2048, max_model_len=512,
                         gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vllm_ckpt"), size="small", seed=0, dtype="bfloat16")


@pytest.fixture(scope="module")
def engine(ckpt):
    from rlactors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_config(CONFIG, ModelConfig(path=str(ckpt), dtype="bfloat16"))
    yield engine
    engine.close()


def test_generates_with_raw_logprobs_seeds_and_stops(engine, ckpt):
    batch = prompts(32)
    requests = {f"r{i}": (p, SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, top_k=20 * (i % 3),
                                            top_p=0.9 if i % 4 == 0 else 1.0, seed=i))
                for i, p in enumerate(batch)}
    done = run(engine, requests)
    assert sorted(done) == sorted(requests)
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" and c.versions == [0] * 24
               for c in done.values())
    model = from_pretrained(ckpt, dtype="float32", device="cuda")
    assert max_logprob_error(model, done.values()) < LOGPROB_ATOL  # raw, not tempered/filtered
    again = run(engine, {k: v for k, v in requests.items() if k in ("r0", "r1", "r2")})
    assert all(again[k].token_ids == done[k].token_ids for k in again)  # same seed, same tokens
    stop = done["r1"].token_ids[5]
    stopped = run(engine, {"s": (batch[1], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop]))})["s"]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stopped.token_ids == done["r1"].token_ids[:len(stopped.token_ids)]


def test_bad_requests_fail_alone_and_abort(engine):
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, sampling, message in [([], SamplingParams(), "empty"),
                                      (list(range(3, 515)), SamplingParams(), "max_model_len"),
                                      ([5], {"max_tokens": 0}, "max_tokens"), ([5], {"temp": 1.0}, "unknown")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, sampling)
    engine.add_request("long", [8, 9], SamplingParams(max_tokens=400))
    engine.step()
    assert engine.abort("long")
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert len(done["ok"].token_ids) == 8 and done["long"].finish_reason == "abort"


def run_streamed(engine, requests: dict) -> dict:
    """`run` with every request streamed: id -> (Completion, the TokenDeltas `sampled` gave after
    each step, as AsyncEngine reads them)."""
    deltas = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, streamed=True)
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
        for rid, got in deltas.items():
            delta = engine.sampled(rid, sum(len(d.token_ids) for d in got))
            if delta is not None and delta.token_ids:
                got.append(delta)
    return {rid: (done[rid], deltas[rid]) for rid in requests}


def test_streamed_requests_equal_unstreamed_ones_and_a_cancelled_stream_leaves_it_serving(engine):
    batch = prompts(8, seed=4)
    requests = {f"q{i}": (p, SamplingParams(max_tokens=32, temperature=0.0 if i % 2 else 1.0, seed=i))
                for i, p in enumerate(batch)}

    def fresh(run_requests):  # the same batch in the same steps: no prompt cached by an earlier run
        engine.reset_prefix_cache()
        return run_requests(engine, requests)

    def same_as_unstreamed(streamed):
        for rid, (completion, deltas) in streamed.items():
            ref = reference[rid]
            assert (completion.token_ids, completion.logprobs, completion.versions, completion.finish_reason) == \
                (ref.token_ids, ref.logprobs, ref.versions, ref.finish_reason), rid
            sent = [t for d in deltas for t in d.token_ids]
            assert [d.start for d in deltas] == [sum(len(e.token_ids) for e in deltas[:k]) for k in range(len(deltas))]
            assert sent == completion.token_ids[:len(sent)]
            assert [lp for d in deltas for lp in d.logprobs] == completion.logprobs[:len(sent)]
            assert len(deltas) >= 16, f"{rid}: {len(deltas)} deltas: its tokens did not come step by step"

    reference = fresh(run)
    assert all(len(c.token_ids) == 32 for c in reference.values())
    same_as_unstreamed(fresh(run_streamed))

    engine.reset_prefix_cache()
    engine.add_request("cancelled", batch[0], SamplingParams(max_tokens=400, seed=9), streamed=True)
    seen = None
    while seen is None or len(seen.token_ids) < 8:
        assert engine.step() == []
        seen = engine.sampled("cancelled")
    assert engine.abort("cancelled")
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert done["cancelled"].finish_reason == "abort"
    assert done["cancelled"].token_ids[:len(seen.token_ids)] == seen.token_ids
    assert engine.sampled("cancelled") is None and not engine.engine.has_unfinished_requests()
    same_as_unstreamed(fresh(run_streamed))  # served as before the cancel, bit for bit


def test_load_weights_changes_outputs_and_versions(engine, ckpt):
    model = from_pretrained(ckpt, dtype="float32", device="cuda")
    batch = prompts(4, seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    before = run(engine, {f"b{i}": (p, greedy) for i, p in enumerate(batch)})
    g = torch.Generator(device="cuda").manual_seed(3)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g, device="cuda"))
           for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights({k: v.to(torch.bfloat16) for k, v in new.items()}, version=5)
    after = run(engine, {f"a{i}": (p, greedy) for i, p in enumerate(batch)})
    assert all(c.versions == [5] * 16 for c in after.values())
    assert any(after[f"a{i}"].token_ids != before[f"b{i}"].token_ids for i in range(4))
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in new.items()}, strict=False)
    assert max_logprob_error(model, after.values()) < LOGPROB_ATOL


def test_router_with_a_vllm_generator_replica(ckpt):
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter
    from rlactors.run.generation import generate

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        router = procs.spawn("router", GeneratorRouter, CONFIG, ModelConfig(path=str(ckpt), dtype="bfloat16"),
                             [[int(os.environ.get("RLACTORS_TEST_GPU", "0"))]])
        batch = prompts(32, seed=2)
        done = await asyncio.gather(*(router.generate.call_one(p, SamplingParams(max_tokens=16, seed=i), f"r{i}")
                                      for i, p in enumerate(batch)))
        assert all(len(c.token_ids) == 16 and c.replica == 0 for c in done)
        deltas = []

        async def on_tokens(delta):
            deltas.append(delta)

        streamed = await generate(router, batch[0], SamplingParams(max_tokens=24, seed=0), "streamed",
                                  on_tokens=on_tokens)  # over Monarch ports, as the gateway streams
        assert len(deltas) > 1 and [t for d in deltas for t in d.token_ids] == streamed.token_ids
        assert [lp for d in deltas for lp in d.logprobs] == streamed.logprobs and len(streamed.token_ids) == 24
        model = from_pretrained(ckpt, dtype="float32", device="cuda")
        state = {k: v.to(torch.bfloat16).cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        result = await router.update_weights.call_one(1, state)
        assert result["replicas"] == [0]
        c = await router.generate.call_one(batch[0], SamplingParams(max_tokens=4), "after")
        assert c.versions == [1] * 4
        replica_pid = (await router.stats.call_one())["replicas"][0]["engine"]["pid"]
        await router.close.call_one()
        await procs.stop()
        return replica_pid

    replica_pid = asyncio.run(main())
    # The replica's process (and the GPU memory its engine holds) is gone soon after the stop.
    deadline = time.monotonic() + 60
    while running(replica_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if running(replica_pid):
        os.kill(replica_pid, signal.SIGKILL)
        pytest.fail(f"the replica's process {replica_pid} still ran 60 s after its procs were stopped (killed)")
