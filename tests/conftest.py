"""Shared fixtures: random-init tiny checkpoints of each model family, built once per test session."""

import os
from pathlib import Path

import pytest

from rlactors.supervision import use_fast_supervision

# Actor procs inherit this environment: Monarch's supervision as the CLI sets it (forced: the fault
# tests' detection times, and their slow procs, depend on it), and each proc kept to one intra-op
# thread on the 2-core CI box, where 2-thread procs contend.
use_fast_supervision(force=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from rlactors.models.tiny import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """``family_ckpt(family, tie=True)``: a tiny checkpoint of ``family`` (``size="tiny"``: GQA
    4q/2kv, fp32, the ChatML tokenizer; seed 0 tied, 1 untied), built once per session."""
    built: dict[tuple[str, bool], Path] = {}

    def get(family: str, tie: bool = True) -> Path:
        if (family, tie) not in built:
            out = tmp_path_factory.mktemp(f"tiny_{family}_{'tied' if tie else 'untied'}")
            built[family, tie] = make_tiny_checkpoint(out, size="tiny", seed=0 if tie else 1,
                                                      tie_word_embeddings=tie, family=family)
        return built[family, tie]

    return get


@pytest.fixture(scope="session")
def tiny_ckpt(family_ckpt) -> Path:
    """Tiny Qwen3 (tied embeddings, GQA 4q/2kv, fp32) with its tokenizer and chat template."""
    return family_ckpt("qwen3")


@pytest.fixture(scope="session")
def tiny_ckpt_untied(family_ckpt) -> Path:
    """Like ``tiny_ckpt`` but with a separate ``lm_head.weight``."""
    return family_ckpt("qwen3", tie=False)
