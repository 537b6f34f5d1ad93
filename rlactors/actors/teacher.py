"""Teacher: the Monarch actor over TeacherScorer (rlactors.trainer.teacher), one proc on each
trainer host (on CUDA sharing the trainer's first GPU of that host), its ranks one process group.

    procs, teacher = await spawn_teacher(this_host(), config.teacher, config.model, config.trainer, kernels)
    await forward_backward(trainer, per_rank, norm, config.loss, teacher)   # scores, then trains
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monarch.actor import Actor, HostMesh, ProcMesh, default_bootstrap_cmd, endpoint
from monarch.spmd import setup_torch_elastic_env_async

from rlactors.config import ModelConfig, TeacherConfig, TrainerConfig
from rlactors.on_policy.sides import TrainerSide
from rlactors.procs.placement import cuda_visible_devices
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.parallel import init_distributed
from rlactors.trainer.teacher import TeacherScorer


class Teacher(Actor):
    def __init__(self, teacher: TeacherConfig, model: ModelConfig, kernels: TrainerSide, device: str,
                 logprob_chunk_tokens: int):
        self.args = (teacher, model, kernels, device, logprob_chunk_tokens)
        self.scorer: TeacherScorer | None = None

    @endpoint
    async def init(self) -> None:
        """Joins the teacher's process group and loads `teacher.path`, its tokenizer checked."""
        teacher, model, kernels, device, chunk = self.args
        if kernels.before_process_group is not None:
            kernels.before_process_group()
        self.scorer = TeacherScorer(teacher, model, init_distributed(device), kernels, chunk)

    @endpoint
    async def score(self, microbatches: Sequence[MicroBatch]) -> list[MicroBatch]:
        if self.scorer is None:
            raise ValueError("Teacher.init has not been called")
        return self.scorer.score(microbatches)


async def spawn_teacher(hosts: HostMesh, teacher: TeacherConfig, model: ModelConfig, trainer: TrainerConfig,
                        kernels: TrainerSide, device: str = "cpu") -> tuple[ProcMesh, Teacher]:
    """Spawns one proc on each host of `hosts` (on CUDA on its GPU 0, the trainer's first) and
    loads the teacher there; returns (procs, actor mesh)."""
    bootstrap_command = (default_bootstrap_cmd().with_env({"CUDA_VISIBLE_DEVICES": cuda_visible_devices([0])})
                         if device == "cuda" else None)
    procs = hosts.spawn_procs(per_host={"gpus": 1}, bootstrap_command=bootstrap_command)
    await setup_torch_elastic_env_async(procs)
    actors = procs.spawn("teacher", Teacher, teacher, model, kernels, device, trainer.logprob_chunk_tokens)
    await actors.init.call()
    return procs, actors


async def score(teacher: Any, microbatches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """`microbatches` scored by every rank of `teacher` (a Teacher mesh); rank 0's answer."""
    from rlactors.procs.placement import first_value

    return first_value(await teacher.score.call(list(microbatches)))
