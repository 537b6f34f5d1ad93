"""Generation engines: the Engine interface, the native PyTorch engine and the vLLM engine."""

from __future__ import annotations

from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.base import Engine


def create_engine(generator_config: GeneratorConfig, model_config: ModelConfig) -> Engine:
    """The engine named by `generator_config.engine`, loaded from `model_config.path`.

    vLLM is imported only here, when asked for, so CPU installs never need it.
    """
    if generator_config.engine == "native":
        from rlactors.engines.native import NativeEngine

        return NativeEngine.from_config(generator_config, model_config)
    if generator_config.engine == "vllm":
        from rlactors.engines.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(generator_config, model_config)
    raise ValueError(f"generator.engine must be 'native' or 'vllm', got {generator_config.engine!r}")


def stages_concurrently(tp: int) -> bool:
    """Whether a replica of `tp` GPUs receives a weight broadcast beside its engine's steps
    (`Engine.stages_concurrently`): one whose one GPU worker runs in the replica's own process
    (the native engine, tp = 1 always; vLLM at tp = 1). With TP workers in other processes, vLLM's
    collective_rpc and step() share its message queues, so a receive waits for a step boundary."""
    return tp == 1


__all__ = ["Engine", "create_engine", "stages_concurrently"]
