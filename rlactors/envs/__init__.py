"""Envs that ship with the library: `DatasetEnv` (questions and reference answers from a dataset)."""

from rlactors.envs.dataset import DatasetEnv, DatasetEnvConfig

__all__ = ["DatasetEnv", "DatasetEnvConfig"]
