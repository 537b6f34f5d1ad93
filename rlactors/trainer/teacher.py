"""The distillation teacher (`teacher.path`): a frozen model with the student's tokenizer that
scores the student's sampled tokens, on procs of its own (rlactors.actors.teacher).

Its ranks hold it sharded like the reference policy (rlactors.trainer.reference: FSDP2, in
`model.dtype`, no gradients); every rank scores the same microbatches. Each microbatch goes to the
trainer with its teacher logprobs (`MicroBatch.teacher_logprobs`), from which the trainer shapes
the advantages (rlactors.trainer.losses.distillation_advantages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from rlactors.config import ConfigError, ModelConfig, TeacherConfig
from rlactors.models.args import DTYPES
from rlactors.models.checkpoint import check_checkpoint_dir, load_args
from rlactors.models.tokenizer import load_tokenizer
from rlactors.on_policy.sides import TrainerSide
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.core import validate_microbatch
from rlactors.trainer.reference import ReferencePolicy


def check_teacher_tokenizer(teacher: str, student: str) -> int:
    """The teacher's vocab size, once its checkpoint dir is whole and its embedding rows and its
    tokenizer's token-to-id map are the student's; else ConfigError naming `teacher.path`."""
    def refused(e: Exception) -> ConfigError:
        return ConfigError(f"teacher.path: {' '.join(str(e).split()) or type(e).__name__}")

    if not Path(teacher).is_dir():
        raise ConfigError(f"teacher.path: checkpoint directory not found: {teacher}")
    try:
        teacher_vocab = load_args(teacher).vocab_size
    except (OSError, ValueError) as e:
        raise refused(e) from None
    student_vocab = load_args(student).vocab_size
    if teacher_vocab != student_vocab:
        raise ConfigError(f"teacher.path: {teacher} has {teacher_vocab} tokens, the student {student_vocab}: "
                          f"a teacher needs the student's tokenizer")
    try:
        check_checkpoint_dir(teacher)
        same = load_tokenizer(teacher).get_vocab() == load_tokenizer(student).get_vocab()
    except (OSError, ValueError) as e:
        raise refused(e) from None
    if not same:
        raise ConfigError(f"teacher.path: {teacher}'s tokenizer maps tokens to other ids than the student's: "
                          f"a teacher needs the student's tokenizer")
    return teacher_vocab


class TeacherScorer:
    """The teacher of `teacher.path` on this process group's ranks, in `model.dtype`."""

    def __init__(self, teacher: TeacherConfig, model: ModelConfig, device: torch.device, kernels: TrainerSide,
                 logprob_chunk_tokens: int = 1024):
        self.vocab_size = check_teacher_tokenizer(teacher.path, model.path)
        self.device = device
        self.policy = ReferencePolicy(load_args(teacher.path), teacher.path, device, DTYPES[model.dtype], kernels,
                                      logprob_chunk_tokens=logprob_chunk_tokens)

    def score(self, microbatches: Sequence[MicroBatch]) -> list[MicroBatch]:
        """`microbatches`, each with the teacher's fp32 logprobs of its targets (on CPU, shaped like
        it) as `teacher_logprobs`; a collective over the ranks."""
        scored = []
        for i, mb in enumerate(microbatches):
            validate_microbatch(mb, self.vocab_size, where=f"microbatches[{i}]")
            logprobs = self.policy.logprobs(mb.to(self.device)).reshape(mb.input_ids.shape).cpu()
            scored.append(dataclasses.replace(mb, teacher_logprobs=logprobs))
        return scored
