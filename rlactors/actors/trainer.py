"""PolicyTrainer: the Monarch actor over PolicyTrainerCore, one per trainer proc (DP rank).

Call every endpoint on the whole mesh (`trainer.optim_step.call()`): each rank runs the same
collectives. Endpoints that take microbatches get all ranks' (`microbatches[r]` is rank r's).

    kernels = sides(config.model.true_on_policy, config.generator.engine, "cpu").trainer
    procs, trainer, ranks = await spawn_trainer(this_host(), config.model, config.trainer, kernels, device="cpu")
    await trainer.forward_backward.call(microbatches, norm, config.loss)   # x k microbatches
    metrics = first_value(await trainer.optim_step.call())   # rank 0's (rlactors.procs.placement.first_value)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import torch
from monarch.actor import Actor, HostMesh, ProcMesh, concurrent_endpoint, default_bootstrap_cmd, endpoint
from monarch.spmd import setup_torch_elastic_env_async

from rlactors.config import LossConfig, ModelConfig, TeacherConfig, TrainerConfig
from rlactors.on_policy.sides import TrainerSide
from rlactors.procs.placement import cuda_visible_devices, free_port, host_name, local_address, num_hosts
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.core import PolicyTrainerCore, VersionedWeights
from rlactors.trainer.losses import LossNorm
from rlactors.trainer.parallel import init_distributed
from rlactors.weight_sync.packed import PackedLayout


class PolicyTrainer(Actor):
    def __init__(self, model: ModelConfig, trainer: TrainerConfig, kernels: TrainerSide, device: str = "cpu",
                 reference: bool = False, teacher: TeacherConfig | None = None):
        self.model_config, self.trainer_config, self.kernels, self.device_type = model, trainer, kernels, device
        self.reference, self.teacher = reference, teacher
        self.core: PolicyTrainerCore | None = None

    @endpoint
    async def init(self) -> dict[str, int]:
        """Joins the process group and loads the policy from `model.path` (policy version 0)."""
        if self.kernels.before_process_group is not None:
            self.kernels.before_process_group()  # before init_distributed makes this process's first communicator
        device = init_distributed(self.device_type)
        self.core = PolicyTrainerCore(self.model_config, self.trainer_config, device, self.kernels, self.reference,
                                      self.teacher)
        return {"rank": self.core.rank, "world_size": self.core.world_size, "host": host_name(), "pid": os.getpid(),
                "policy_version": self.core.version}

    @endpoint
    async def forward_backward(self, microbatches: Sequence[MicroBatch], norm: LossNorm,
                               loss: LossConfig) -> dict[str, int]:
        return self._core().forward_backward(microbatches, norm, loss)

    @endpoint
    async def optim_step(self) -> dict[str, float]:
        return self._core().optim_step()

    @endpoint
    async def compute_logprobs(self, microbatches: Sequence[MicroBatch]) -> torch.Tensor:
        return self._core().compute_logprobs(microbatches)

    @endpoint
    async def state_dict_for_sync(self, dtype: str | None = None) -> VersionedWeights | None:
        return self._core().state_dict_for_sync(dtype)

    @endpoint
    async def weight_sync_address(self) -> tuple[str, int]:
        """An address and free port on this rank's host for the weight broadcast group's rendezvous."""
        return local_address(), free_port()

    @endpoint
    async def weight_layout(self, dtype: str | None = None):
        return self._core().weight_layout(dtype)

    @endpoint
    async def init_weight_sender(self, host: str, port: int, world_size: int, layout: PackedLayout) -> None:
        self._core().init_weight_sender(host, port, world_size, layout)

    @endpoint
    async def share_weights(self, dtype: str | None = None) -> dict[str, Any] | None:
        return self._core().share_weights(dtype)

    # Concurrent, so that an abort is served while a broadcast waits for a dead member (NCCL),
    # and so that a send called with the optimizer step that makes `version` waits for it.
    @concurrent_endpoint
    async def send_weights(self, version: int):
        return await self._core().send_weights(version)

    @concurrent_endpoint
    async def abort_weight_broadcast(self) -> None:
        self._core().abort_weight_broadcast()

    @endpoint
    async def release_memory(self) -> dict[str, float]:
        return self._core().release_memory()

    @endpoint
    async def save_checkpoint(self, root: str, step: int, extra_files: dict[str, str] | None = None) -> str:
        return self._core().save_checkpoint(root, step, extra_files)

    @endpoint
    async def load_checkpoint(self, path: str) -> dict[str, int]:
        return self._core().load_checkpoint(path)

    def _core(self) -> PolicyTrainerCore:
        if self.core is None:
            raise ValueError("PolicyTrainer.init has not been called")
        return self.core


async def spawn_trainer(hosts: HostMesh, model: ModelConfig, trainer: TrainerConfig, kernels: TrainerSide,
                        device: str = "cpu", first_gpu: int = 0, reference: bool = False,
                        teacher: TeacherConfig | None = None,
                        ) -> tuple[ProcMesh, PolicyTrainer, list[dict[str, Any]]]:
    """Spawns `trainer.ranks` procs split evenly over the hosts of `hosts` (on CUDA one GPU each:
    first_gpu, first_gpu + 1, ... of its host), sets the torch elastic env (ranks host-major), and
    initialises a PolicyTrainer on each. Returns (procs, actor mesh, each rank's `init` answer:
    rank, world size, host, policy version). `kernels`: what the trainer runs
    (`rlactors.on_policy.sides`); `reference`: each rank also holds the initial weights frozen, for
    `loss.kl_coef` (`rlactors.trainer.reference`); `teacher`: the distillation settings, when its
    path is set (the microbatches come scored by the teacher mesh, rlactors.actors.teacher)."""
    if device == "cuda":
        def bootstrap_command(point):
            gpu = cuda_visible_devices([first_gpu + point["gpus"]])
            return default_bootstrap_cmd().with_env({"CUDA_VISIBLE_DEVICES": gpu})
    else:
        bootstrap_command = None
    # The ranks split evenly over the hosts (Config.validate).
    procs = hosts.spawn_procs(per_host={"gpus": trainer.ranks // num_hosts(hosts)},
                              bootstrap_command=bootstrap_command)
    await setup_torch_elastic_env_async(procs)
    actors = procs.spawn("policy_trainer", PolicyTrainer, model, trainer, kernels, device, reference,
                         teacher)
    ranks = sorted((value for _, value in (await actors.init.call()).items()), key=lambda r: r["rank"])
    return procs, actors, ranks


async def forward_backward(trainer: Any, per_rank: Sequence[Sequence[MicroBatch]], norm: LossNorm,
                           loss: LossConfig, teacher: Any = None) -> None:
    """The gradients of one optimizer step of `trainer` (a PolicyTrainer mesh), accumulated over
    each rank's microbatches; with `teacher` (a Teacher mesh, rlactors.actors.teacher) each call's
    microbatches go scored by it, the next call's scored while the trainer runs this one."""
    from rlactors.actors.teacher import score

    # Sent as soon as they are ready: an actor serves its calls in order, and the trainer never
    # waits for the host.
    calls = []
    try:
        for j in range(len(per_rank[0])):
            mbs = [mbs[j] for mbs in per_rank]
            calls.append(trainer.forward_backward.call(await score(teacher, mbs) if teacher is not None else mbs,
                                                       norm, loss))
    except BaseException:
        for call in calls:  # the step fails with the teacher's error; these end by themselves
            asyncio.ensure_future(call).add_done_callback(lambda f: f.cancelled() or f.exception())
        raise
    await asyncio.gather(*calls)
