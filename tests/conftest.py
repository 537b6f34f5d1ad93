"""Shared fixtures: random-init tiny Qwen3 checkpoints, built once per test session."""

import os
from pathlib import Path

import pytest

from rlactors.supervision import use_fast_supervision

# Actor procs inherit this environment: detect a dead proc within a second (forced: the fault
# tests' detection times depend on it), and keep each proc to one intra-op thread on the 2-core
# CI box, where 2-thread procs contend.
use_fast_supervision(force=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rlactors.models.tiny import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Tiny Qwen3 (tied embeddings, GQA 4q/2kv, fp32) with its tokenizer and chat template."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_untied(tmp_path_factory) -> Path:
    """Like ``tiny_ckpt`` but with a separate ``lm_head.weight``."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_untied"), size="tiny", seed=1,
                                tie_word_embeddings=False)
