"""What closing an in-process vLLM engine gives back, checked on CPU with stand-ins for the vLLM
objects it touches (the GPU suite checks the memory itself): the KV cache leaves the attention
layers, even though vLLM's shutdown empties the layer registry first, and the next engine in the
process gets a CUDA graph pool of its own."""

from __future__ import annotations

import sys
import types

import torch

from rlactors import vllm_api
from rlactors.engines.vllm_engine import VLLMEngine


class Platform:
    _global_graph_pool = ("pool", 1)  # vLLM's process-wide pool id: a class attribute


class Layer:
    def __init__(self) -> None:
        self.kv_cache = torch.zeros(4, 8)


class EngineCore:
    def __init__(self, registry: dict) -> None:
        self.registry = registry
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True
        self.registry.clear()  # as vLLM's model runner does at shutdown


def fake_vllm(monkeypatch) -> None:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = vllm_api.SUPPORTED[0]
    vllm.SamplingParams = object
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = Platform()
    for name, module in {"vllm": vllm, "vllm.sampling_params": sampling, "vllm.platforms": platforms}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_close_drops_the_kv_cache_from_the_layers_and_the_graph_pool_id(monkeypatch):
    fake_vllm(monkeypatch)
    layers = {"model.layers.0.self_attn.attn": Layer(), "model.layers.1.self_attn.attn": Layer(),
              "model.layers.1.mlp.experts": types.SimpleNamespace()}  # a registered layer without a cache
    core = EngineCore(layers)
    llm_engine = types.SimpleNamespace(
        engine_core=core, vllm_config=types.SimpleNamespace(compilation_config=types.SimpleNamespace(
            static_forward_context=layers)))
    attention = [layers["model.layers.0.self_attn.attn"], layers["model.layers.1.self_attn.attn"]]
    engine = VLLMEngine(llm_engine, vocab_size=16, max_model_len=32)

    engine.close()

    assert core.shut_down and engine.engine is None
    assert all(layer.kv_cache.numel() == 0 for layer in attention)
    assert Platform._global_graph_pool is None
