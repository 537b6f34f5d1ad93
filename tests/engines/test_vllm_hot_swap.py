"""A weight load while requests run (hot swap) in the vLLM engine, on CPU, against a stand-in for
vLLM's in-process engine as vLLM 0.31's source has it: under async scheduling one step stays in
flight past the one `step()` returns; a reset of the running requests preempts them and drops the
tokens of the steps in flight, which are sampled again; and an engine that returns routed experts
refuses that reset unless its scheduler is paused with no step in flight. Each stand-in token is
the version of the weights that sampled it, so every completion must carry its tokens as its
versions. The GPU suite runs the same on vLLM itself (tests/engines/test_vllm_families.py)."""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch

from rlactors import vllm_api
from rlactors.engines.vllm_engine import VLLMEngine
from rlactors.types import SamplingParams

PROMPT = [1, 2, 3]
LAYERS = 2  # the stand-in model's layers, both sparse


class Core:
    """vLLM's EngineCore, as far as a weight load meets it."""

    def __init__(self, returns_routed_experts: bool):
        self.returns_routed_experts = returns_routed_experts
        self.batch_queue: collections.deque[dict[str, int]] = collections.deque()  # newest first
        self.paused = False

    def pause_scheduler(self, mode: str, clear_cache: bool) -> None:
        assert (mode, clear_cache) == ("keep", False)
        self.paused = True

    def resume_scheduler(self) -> None:
        self.paused = False

    def is_scheduler_paused(self) -> bool:
        return self.paused


class LLMEngine:
    def __init__(self, returns_routed_experts: bool):
        self.core = Core(returns_routed_experts)
        self.engine_core = types.SimpleNamespace(engine_core=self.core)
        self.weights = 0  # the version of the weights the model holds
        self.running: dict[str, types.SimpleNamespace] = {}
        self.resets = 0

    def add_request(self, request_id: str, prompt: dict, params: types.SimpleNamespace) -> None:
        self.running[request_id] = types.SimpleNamespace(
            prompt=len(prompt["prompt_token_ids"]), max_tokens=params.max_tokens, scheduled=0, sampled=0)

    def apply_model(self, fn) -> None:
        fn(types.SimpleNamespace(load_weights=lambda weights: setattr(self, "weights", int(dict(weights)["w"]))))

    def step(self) -> list[types.SimpleNamespace]:
        if not self.core.paused:  # schedules a step: one token for each request that wants one
            batch = {rid: self.weights for rid, r in self.running.items() if r.scheduled < r.max_tokens}
            for rid in batch:
                self.running[rid].scheduled += 1
            if batch:
                self.core.batch_queue.appendleft(batch)
            if len(self.core.batch_queue) < 2 and batch:
                return []  # the queue is not full: no output yet
        if not self.core.batch_queue:
            return []
        return [self._output(rid, token) for rid, token in self.core.batch_queue.pop().items()]

    def _output(self, request_id: str, token: int) -> types.SimpleNamespace:
        r = self.running[request_id]
        r.sampled += 1
        finished = r.sampled == r.max_tokens
        if finished:
            del self.running[request_id]
        returns_routed = finished and self.core.returns_routed_experts
        routed = torch.zeros(r.prompt + r.sampled - 1, LAYERS, 2) if returns_routed else None
        return types.SimpleNamespace(request_id=request_id, finished=finished, outputs=[types.SimpleNamespace(
            token_ids=[token], logprobs=[{token: types.SimpleNamespace(logprob=-1.0)}],
            finish_reason="length" if finished else None, routed_experts=routed)])

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert reset_running_requests
        if self.core.returns_routed_experts and (not self.core.paused or self.core.batch_queue):
            raise RuntimeError("AuxOutput Connector only supports resetting running requests after pause(mode='keep').")
        for batch in self.core.batch_queue:  # preempted: their tokens in flight are dropped, sampled again
            for rid in batch:
                self.running[rid].scheduled -= 1
        self.core.batch_queue.clear()
        self.resets += 1
        return True


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.__version__ = vllm_api.SUPPORTED[0]
    vllm.SamplingParams = types.SimpleNamespace
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    for name, module in {"vllm": vllm, "vllm.sampling_params": sampling}.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("routed_experts", [False, True])
def test_a_load_while_requests_run_tags_each_token_with_the_weights_that_sampled_it(routed_experts):
    llm_engine = LLMEngine(routed_experts)
    engine = VLLMEngine(llm_engine, vocab_size=16, max_model_len=64, hot_swaps=True,
                        sparse_layers=list(range(LAYERS)) if routed_experts else None)
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=6, temperature=0.0))
    done = {}
    while len(engine.sampled("a").token_ids) < 2:
        done.update({c.request_id: c for c in engine.step()})
    assert llm_engine.core.batch_queue  # a step is in flight as the weights change

    engine.load_weights({"w": torch.tensor(1)}, version=1)

    assert llm_engine.resets == 1 and not llm_engine.core.paused
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    for c in done.values():
        assert c.token_ids == c.versions, c.request_id
        assert c.versions[:2] == [0, 0] and c.versions[-1] == 1 and len(c.versions) == 6
        assert (c.routed_experts is not None) == routed_experts
        if routed_experts:
            assert len(c.routed_experts) == 6
    # Only an engine returning routed experts waits for its step in flight: its token keeps the old version.
    assert all(c.versions.count(0) == (3 if routed_experts else 2) for c in done.values())


def test_a_failed_load_leaves_the_scheduler_running_and_the_version_unchanged():
    llm_engine = LLMEngine(returns_routed_experts=True)
    engine = VLLMEngine(llm_engine, vocab_size=16, max_model_len=64, sparse_layers=list(range(LAYERS)))
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=6, temperature=0.0))
    engine.step()
    with pytest.raises(ValueError, match="no weights given"):
        engine.load_weights({}, version=1)

    def broken(fn):
        raise RuntimeError("load failed")

    llm_engine.apply_model = broken
    with pytest.raises(RuntimeError, match="load failed"):
        engine.load_weights({"w": torch.tensor(1)}, version=1)
    assert not llm_engine.core.paused and engine.version == 0 and llm_engine.resets == 0


def test_a_load_into_a_sleeping_engine_leaves_its_scheduler_paused():
    """Colocated, weights load after the weights wake and before the KV cache does: vLLM keeps the
    scheduler paused until the whole engine is awake, and the load must not resume it."""
    llm_engine = LLMEngine(returns_routed_experts=True)
    engine = VLLMEngine(llm_engine, vocab_size=16, max_model_len=64, sparse_layers=list(range(LAYERS)))
    llm_engine.core.paused = True  # as vLLM's sleep(mode="keep") leaves it
    engine.load_weights({"w": torch.tensor(1)}, version=1)
    assert llm_engine.core.paused and llm_engine.resets == 1 and engine.version == 1
