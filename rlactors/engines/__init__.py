"""Generation engines: the Engine interface, the native PyTorch engine and the vLLM engine."""

from __future__ import annotations

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.base import Engine


def create_engine(generator_config: GeneratorConfig, model_config: ModelConfig,
                  kv_cache_bytes: int | None = None) -> Engine:
    """The engine named by `generator_config.engine`, loaded from `model_config.path`; vLLM's KV
    cache of `kv_cache_bytes` per GPU when given (else sized by vLLM's profile).

    vLLM is imported only here, when asked for, so CPU installs never need it.
    """
    if generator_config.engine == "native":
        from rlactors.engines.native import NativeEngine

        return NativeEngine.from_config(generator_config, model_config)
    if generator_config.engine == "vllm":
        from rlactors.engines.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(generator_config, model_config, kv_cache_bytes=kv_cache_bytes)
    raise ValueError(f"generator.engine must be 'native' or 'vllm', got {generator_config.engine!r}")


__all__ = ["Engine", "create_engine"]
