"""Native engine: continuous batching, paged KV cache, sampling, logprobs (every model family),
weights, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from support.threads import one_thread  # noqa: F401 - this module's autouse fixture

from rlactors.config import GeneratorConfig
from rlactors.engines.kv_cache import BlockPool
from rlactors.engines.native import NativeEngine
from rlactors.engines.sampling import filter_top_k_top_p, sample
from rlactors.models.args import FAMILIES
from rlactors.models.checkpoint import from_pretrained
from rlactors.types import SamplingParams

VOCAB = 1024  # the tiny checkpoint's


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return from_pretrained(tiny_ckpt, dtype="float32")


def make_engine(model, **kwargs) -> NativeEngine:
    options = dict(max_num_seqs=16, max_num_tokens=256, kv_cache_tokens=2048, block_size=16, max_model_len=512)
    options.update(kwargs)
    return NativeEngine(model, GeneratorConfig(**options))


def prompts(n: int, low: int = 1, high: int = 60, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def run(engine: NativeEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    return done


def reference_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """What the trainer computes: one packed forward over prompt + completion."""
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        hidden = model.forward_packed(ids, torch.arange(len(ids)), backend="sdpa")
        return model.token_logprobs(hidden[:-1], ids[1:])[len(prompt) - 1:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_match_full_forward_under_preemption_and_chunked_prefill(family, family_ckpt):
    model = from_pretrained(family_ckpt(family), dtype="float32")
    # A cache of 40 blocks for 24 requests of up to 60 + 24 tokens forces preemptions; a 96-token
    # budget forces chunked prefills; greedy and sampled rows with top-k/top-p share steps, and
    # up to 24 decodes split into groups by context length.
    engine = make_engine(model, max_num_seqs=24, max_num_tokens=96, kv_cache_tokens=640, max_model_len=192)
    requests = {}
    for i, prompt in enumerate(prompts(24, seed=1)):
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 3 == 0 else 1.0,
                                top_k=20 if i % 3 == 1 else 0, top_p=0.8 if i % 4 == 1 else 1.0, seed=i)
        requests[f"r{i}"] = (prompt, params)
    done = run(engine, requests)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["running"] == stats["waiting"] == 0
    assert stats["free_blocks"] == stats["total_blocks"]  # every block came back
    assert set(done) == set(requests)
    for rid, c in done.items():
        assert c.finish_reason == "length" and len(c.token_ids) == 24
        assert c.prompt_token_ids == requests[rid][0] and c.versions == [0] * 24
        ref = reference_logprobs(model, c.prompt_token_ids, c.token_ids)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-4, rid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_hf_transformers_generate(family, family_ckpt):
    from transformers import AutoModelForCausalLM

    ckpt = family_ckpt(family, tie=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = make_engine(from_pretrained(ckpt, dtype="float32"))
    batch = prompts(2, low=5, high=30, seed=2)
    done = run(engine, {f"r{i}": (p, SamplingParams(max_tokens=10, temperature=0.0)) for i, p in enumerate(batch)})
    for i, p in enumerate(batch):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert done[f"r{i}"].token_ids == out[0, len(p):].tolist()


def test_requests_join_and_leave_between_steps(model):
    engine = make_engine(model, max_num_seqs=4)
    engine.add_request("long", prompts(1, seed=3)[0], SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    engine.step()
    finished_at, step = {}, 2
    engine.add_request("short", prompts(1, seed=4)[0], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished():
        step += 1
        for c in engine.step():
            finished_at[c.request_id] = (step, len(c.token_ids))
        if step == 5:
            assert engine.stats()["running"] == 1  # "short" left while "long" decodes on
            engine.add_request("late", prompts(1, seed=5)[0], SamplingParams(max_tokens=2, temperature=0.0))
    assert finished_at["short"] == (5, 3)  # joined at step 3, one token per step
    assert finished_at["late"] == (7, 2)
    assert finished_at["long"] == (30, 30)


def test_admission_respects_max_num_seqs_and_token_budget(model):
    engine = make_engine(model, max_num_seqs=3, max_num_tokens=40)
    requests = {f"r{i}": (p, SamplingParams(max_tokens=5, temperature=0.0)) for i, p in enumerate(prompts(8, 30, 30))}
    for rid, (p, params) in requests.items():
        engine.add_request(rid, p, params)
    done, computed, steps = {}, 0, 0
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
        steps += 1
        assert len(engine.scheduler.running) <= 3
        assert engine.counters["computed_tokens"] - computed <= 40
        computed = engine.counters["computed_tokens"]
    assert sorted(done) == sorted(requests) and all(len(c.token_ids) == 5 for c in done.values())
    # 8 prompts of 30 tokens through a 40-token budget: prefills are chunked across steps.
    assert computed == 8 * (30 + 4) and steps >= 8 * 30 // 40


def test_same_seed_same_tokens_alone_or_batched(model):
    target = prompts(1, 20, 20, seed=6)[0]
    others = prompts(5, 30, 60, seed=7)
    for params in (SamplingParams(max_tokens=12, temperature=0.0),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=1234),
                   SamplingParams(max_tokens=12, temperature=0.7, top_k=50, top_p=0.9, seed=99)):
        alone = run(make_engine(model), {"t": (target, params)})["t"]
        crowd = {"t": (target, params)}
        crowd.update({f"o{i}": (p, SamplingParams(max_tokens=14, temperature=1.0, seed=i))
                      for i, p in enumerate(others)})
        engine = make_engine(model, max_num_tokens=64)  # chunked prefills mixed with the target's decodes
        engine.add_request("early", others[0], SamplingParams(max_tokens=14))
        engine.step()
        batched = run(engine, crowd)["t"]
        assert batched.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    different_seed = run(make_engine(model), {"t": (target, SamplingParams(max_tokens=12, seed=1235))})["t"]
    seeded = run(make_engine(model), {"t": (target, SamplingParams(max_tokens=12, seed=1234))})["t"]
    assert different_seed.token_ids != seeded.token_ids


def test_stop_tokens_max_tokens_and_context_end(model):
    prompt = prompts(1, 10, 10, seed=8)[0]
    free = run(make_engine(model), {"a": (prompt, SamplingParams(max_tokens=10, temperature=0.0))})["a"]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    stopped = run(make_engine(model), {"a": (prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                                      stop_token_ids=[stop]))})["a"]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    capped = run(make_engine(model, max_model_len=16, kv_cache_tokens=64),
                 {"a": (prompt, SamplingParams(max_tokens=100, temperature=0.0))})["a"]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 6  # 10 + 6 = max_model_len


def test_abort_returns_partial_completion_and_frees_blocks(model):
    engine = make_engine(model)
    engine.add_request("a", prompts(1, seed=9)[0], SamplingParams(max_tokens=50))
    engine.add_request("b", prompts(1, seed=10)[0], SamplingParams(max_tokens=5, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("unknown")
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert done["a"].finish_reason == "abort" and len(done["a"].token_ids) == 3
    assert done["b"].finish_reason == "length" and len(done["b"].token_ids) == 5
    assert engine.stats()["free_blocks"] == engine.stats()["total_blocks"]


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], SamplingParams(), "prompt_token_ids is empty"),
    (list(range(3, 3 + 512)), SamplingParams(), "max_model_len=512"),
    ([5, VOCAB], SamplingParams(), "outside the vocabulary"),
    ([5, 6], {"max_tokens": 4, "temprature": 1.0}, "unknown SamplingParams key"),
    ([5, 6], {"max_tokens": 0}, "max_tokens must be >= 1"),
    ([5, 6], {"max_tokens": 4, "stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
    ([5, 6.5], SamplingParams(), "malformed request"),
    ([5, 6], {"max_tokens": "4"}, "malformed request"),
])
def test_bad_requests_fail_alone(model, prompt, sampling, message):
    engine = make_engine(model)
    engine.add_request("good1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, sampling)
    engine.add_request("good2", [8, 9], {"max_tokens": 3})
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("good2", [8, 9], {"max_tokens": 3})
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert sorted(done) == ["good1", "good2"] and len(done["good1"].token_ids) == 4


def test_prefix_cache_reuses_blocks_until_reset(model):
    engine = make_engine(model)
    prompt = prompts(1, 50, 50, seed=11)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = run(engine, {"a": (prompt, greedy)})["a"]
    assert engine.stats()["prefix_hit_tokens"] == 0
    again = run(engine, {"b": (prompt, greedy)})["b"]
    assert engine.stats()["prefix_hit_tokens"] == 48  # three full blocks of 16
    assert again.token_ids == first.token_ids
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(first.logprobs), atol=1e-5)
    # A multi-turn continuation hits the blocks of the previous turn's prompt and completion.
    turn2 = prompt + first.token_ids + [7, 8, 9]
    cont = run(engine, {"c": (turn2, greedy)})["c"]
    assert engine.stats()["prefix_hit_tokens"] == 48 + 48
    ref = reference_logprobs(model, turn2, cont.token_ids)
    assert (ref - torch.tensor(cont.logprobs)).abs().max().item() < 1e-4
    engine.reset_prefix_cache()
    run(engine, {"d": (prompt, greedy)})
    assert engine.stats()["prefix_hit_tokens"] == 96


def test_load_weights_changes_outputs_and_version_or_rejects_bad_weights(model, tiny_ckpt):
    engine = make_engine(from_pretrained(tiny_ckpt, dtype="float32"))
    prompt = prompts(1, 20, 20, seed=12)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    before = run(engine, {"a": (prompt, greedy)})["a"]
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    bad_shape = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.load_weights(bad_shape, version=1)
    with pytest.raises(ValueError, match="unknown"):
        engine.load_weights(dict(state, extra=torch.ones(1)), version=1)
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({"model.norm.weight": state["model.norm.weight"]}, version=1)
    assert engine.version == 0
    assert run(engine, {"b": (prompt, greedy)})["b"].token_ids == before.token_ids
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    engine.load_weights(new, version=7)
    after = run(engine, {"c": (prompt, greedy)})["c"]
    assert after.versions == [7] * 6 and after.token_ids != before.token_ids
    assert engine.stats()["prefix_hit_tokens"] == 16  # "b" hit "a"'s block; "c" hit nothing


def test_block_pool_evicts_least_recently_freed_cached_blocks():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(2)
    pool.cache(a[0], key=100)
    pool.cache(a[1], key=101)
    pool.release(a)
    assert pool.num_free == 4 and pool.lookup([100, 101, 102]) == a
    pool.acquire(pool.lookup([100]))
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    fresh = pool.allocate(3)  # the two never-cached blocks first, then the evictable a[1]
    assert a[1] in fresh and pool.lookup([100, 101]) == [a[0]]
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        pool.allocate(1)


def test_sampler_draws_from_the_filtered_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9)] * n
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, logprobs = sample(logits.expand(n, -1), params, generators)
    expected = filter_top_k_top_p((logits / 0.7)[None], torch.tensor([4]), torch.tensor([0.9]))[0].softmax(-1)
    assert expected[3:].sum() == 0 and expected[2] > 0  # top-k cut 4 tokens, top-p cut one more
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert (freq - expected).abs().max() < 0.015
    # Logprobs are of the raw distribution, whatever the sampling params.
    assert torch.allclose(logprobs, logits.log_softmax(-1)[tokens])
    greedy, _ = sample(logits[None], [SamplingParams(temperature=0.0)], [torch.Generator()])
    top1, _ = sample(logits[None], [SamplingParams(top_k=1, seed=0)], [torch.Generator().manual_seed(3)])
    assert greedy.item() == top1.item() == 0
    assert math.isclose(filter_top_k_top_p(logits[None], torch.tensor([0]), torch.tensor([1.0]))[0].sum().item(),
                        logits.sum().item(), rel_tol=1e-6)
