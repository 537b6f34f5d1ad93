"""Controller: from one Config, spawn the procs (rlactors.run.meshes) and train, one step at a time.

Each step takes `rollout.prompts_per_step` finished groups from a RolloutProducer (sync and async
are one loop), drops episodes older than `controller.max_staleness` versions, trains, checkpoints
when due, and pushes the new weights to every replica (rlactors.weight_sync.sync). What stops a
run, saved, and what a Ctrl-C keeps: docs/ARCHITECTURE.md (Controller) and docs/failures.md; a
dead trainer rank's rebuild: rlactors.run.recovery; the run dir's rules: rlactors.run.run_dir.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from rlactors.config import Config
from rlactors.procs.liveness import ProcLost
from rlactors.procs.placement import placement_line
from rlactors.procs.watchdog import LoopWatchdog
from rlactors.rollout.env import OnTokens
from rlactors.rollout.producer import RolloutProducer, fresh_episodes
from rlactors.rollout.rollouter import group_number
from rlactors.rollout.types import Episode, RolloutGroup
from rlactors.run.evaluation import EvalSchedule, Evaluator
from rlactors.run.generation import generate, replicas_lost, serve_gateway
from rlactors.run.inputs import load_inputs
from rlactors.run.memory_plan import MemoryPlan, out_of_memory
from rlactors.run.meshes import HostsLost, Meshes
from rlactors.run.metrics import (
    EnvErrorLog,
    ErroredSteps,
    GeneratorMetrics,
    MetricsLogger,
    WandbSink,
    sample_records,
    step_metrics,
    untrained_reason,
)
from rlactors.run.optimizer_step import UpdateSkipped, optimizer_step
from rlactors.run.recovery import TrainerRestarts, recovery_point, train_with_restarts
from rlactors.run.run_dir import SLURM_DIR, ResumeState, RunComplete, RunDir, TrainingError
from rlactors.run.turns import NoTurns, Turns, take_turns
from rlactors.storage.records import is_storage_fault
from rlactors.types import Completion, SamplingParams
from rlactors.weight_sync.sync import BroadcastStuck, NoReplicaUp, WeightSync, WeightSyncError, create_weight_sync


class Controller:
    """Owns the meshes of one run. `await Controller(config).run()` trains and returns metrics."""

    def __init__(self, config: Config, resume: bool = False):
        self.config = config
        self.resume = resume
        self.run_dir = RunDir(config.controller.run_dir)
        self.step = 0
        self.policy_version = 0  # the trainer's
        self.producer: RolloutProducer | None = None  # while train() runs
        self.interrupt_report: str | None = None  # the line that says what Ctrl-C kept
        self.meshes = Meshes(config)
        self._generator_metrics = GeneratorMetrics()
        self._env_errors: EnvErrorLog | None = None  # while train() runs
        self.evaluator: Evaluator | None = None  # with controller.eval_every (rlactors.run.evaluation)
        self.trainer = self.router = None  # guarded by the meshes' watcher
        self.turns = NoTurns()  # colocated engines that sleep: Turns, once the meshes are up
        self.weight_sync: WeightSync | None = None
        # While training, a call that blocks the loop (an env's) is named after step_timeout_s.
        self.watchdog = LoopWatchdog(after_s=config.rollout.step_timeout_s)
        self.gateway = None  # an AgentEnv's harnesses call the policy through it (rlactors.gateway)
        self.trainer_restarts = TrainerRestarts(config.controller.restart_trainer)
        self.memory_plan: MemoryPlan | None = None  # on CUDA, once start() has checked it
        self.errored_steps = ErroredSteps(config.controller.max_errored_steps)

    async def start(self) -> None:
        c = self.config
        resume_from = self.run_dir.check(c, self.resume)  # fails (or finds the run complete) before any proc starts
        inputs = await load_inputs(c, self.generate)
        self.tokenizer, self.samples, self.rollouter = inputs.tokenizer, inputs.samples, inputs.rollouter
        self.evaluator, self.batcher, self.memory_plan = inputs.evaluator, inputs.batcher, inputs.memory

        spawned = time.monotonic()
        self.trainer, self.router, ranks = await self.meshes.spawn(self.run_dir.path / SLURM_DIR)
        stats = await self.meshes.router_stats(self.router)  # once every replica has started
        print(f"{placement_line(ranks, stats)} (the trainer ready after {self.meshes.trainer_ready_s:.0f} s, "
              f"the generators after {time.monotonic() - spawned:.0f} s)", flush=True)
        self.gateway = await serve_gateway(inputs.env, c, self.tokenizer)

        if c.generator.sleep:
            self.turns = Turns(self.trainer, self.router)
        await self._attach(self.trainer)
        self.run_dir.write_config(c)
        # Where a trainer rebuilt before the first checkpoint starts again (rlactors.run.recovery).
        self._start_state = ResumeState(0, 0, self.samples.state_dict(), self.rollouter.state_dict())
        if resume_from is not None:
            await self._restore(resume_from, ResumeState.read(resume_from))
            print(f"resumed from {resume_from} at step {self.step} (policy version {self.policy_version})", flush=True)

    async def _restore(self, checkpoint: Path | None, state: ResumeState) -> None:
        """The trainer, the run's state and the generators' policy as of `state` and `checkpoint` (None: model.path)."""
        if checkpoint is not None:
            await self.trainer.load_checkpoint.call(str(checkpoint))
        self.samples.load_state_dict(state.samples)
        self.rollouter.load_state_dict(state.rollouter)
        self.step, self.policy_version = state.step, state.policy_version
        # The generators hold model.path's policy, or a later one: give them this one before any rollout.
        await self._sync_call(self.push_weights(self.policy_version))

    async def _attach(self, trainer: Any) -> None:
        """`trainer` becomes the run's, with a weight sync of its own to the router's replicas."""
        self.trainer = trainer
        self.weight_sync = create_weight_sync(self.config, trainer, self.router)
        await self._sync_call(self.weight_sync.start())

    async def recover_trainer(self, cause: str) -> int:
        """Rebuilds the trainer from the last complete checkpoint after one of its ranks died (`cause`),
        brings the run and the generators back to it, says so; the step it stands at."""
        start, lost_in = time.monotonic(), self.step + 1
        point = recovery_point(self.run_dir, self._start_state)
        self.step, self.policy_version = point.state.step, point.state.policy_version  # a Ctrl-C saves no more
        try:
            await self._attach((await self.meshes.respawn_trainer())[0])
            await self._restore(point.checkpoint, point.state)
        except (SupervisionError, ProcLost) as e:
            raise TrainingError(self.run_dir.resumable(f"rebuilding the trainer after {cause}: "
                                                       f"{await self.meshes.cause(e)}")) from None
        print(self.trainer_restarts.recovered_line(lost_in, cause, point, time.monotonic() - start), flush=True)
        return self.step

    def _ran_out_line(self, call: str, said: str) -> str:
        """The error line of a run stopped by `call` running out of GPU memory. Nothing is saved:
        a call that failed part way (the optimizer's step, a layer group at a time) leaves the
        trainer in no step's state, so the run resumes from its last complete checkpoint."""
        where = f"step {self.step + 1}" if self.producer is not None else "starting"
        what = (self.memory_plan.ran_out_line(call, said) if self.memory_plan is not None
                else f"{call} ran out of GPU memory ({said})")
        return self.run_dir.resumable(f"{where}: {what}")

    async def shutdown(self) -> None:
        """Stops the gateway, the router and the procs (`Meshes.shutdown`: killed if they hang)."""
        await self.meshes.shutdown(self._stop)

    async def _stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        await self.meshes.stop(self.router)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                       session_id: str | None = None, on_tokens: OnTokens | None = None) -> Completion:
        """One completion from the router: what rollouts (`on_tokens`: streamed) and evaluations call."""
        return await generate(self.router, prompt_token_ids, sampling, request_id, session_id, on_tokens=on_tokens)

    async def push_weights(self, version: int) -> dict[str, float]:
        """The trainer's policy `version` (current, or its step's under way) to every replica; its timings."""
        return await self.weight_sync.push(version)

    async def _sync_call(self, call: Awaitable[Any]) -> Any:
        """`call` (a WeightSync step), its failure as the TrainingError that stops the run."""
        try:
            return await call
        except NoReplicaUp as e:
            saved = await self._save_step_once() if self.step else "no step was trained yet"
            raise TrainingError(f"{e}; {saved}") from None
        except BroadcastStuck as e:  # the trainer is stuck in the collective: nothing more is saved
            raise TrainingError(self.run_dir.resumable(str(e))) from None
        except WeightSyncError as e:
            raise TrainingError(str(e)) from None

    async def run(self) -> list[dict[str, float]]:
        """Starts the meshes, trains `controller.steps` steps, shuts down; per-step metrics. Cancelled
        (the first Ctrl-C, `rlactors.train.run_controller`), it keeps the last completed step."""
        try:
            await self.start()
            return await self.meshes.while_hosts_hold(self.train())
        except HostsLost as lost:
            raise TrainingError(self.run_dir.resumable(f"step {self.step + 1}: {lost}")) from None
        except RunComplete as complete:
            print(complete, flush=True)
            return []
        except ProcLost as e:  # while starting: no step to name
            raise TrainingError(f"{e}; {self.run_dir.last_checkpoint()}") from None
        except ActorError as e:
            if (ran_out := out_of_memory(e)) is None:
                raise
            raise TrainingError(self._ran_out_line(*ran_out)) from None
        except OSError as e:  # a record, sample or plot that the disk refused (a checkpoint: save_checkpoint)
            if is_storage_fault(e):
                raise TrainingError(self.run_dir.storage_error(e)) from None
            raise
        except asyncio.CancelledError:
            await self.keep_last_step()
            raise
        finally:
            await self.shutdown()

    async def keep_last_step(self) -> None:
        """After Ctrl-C: saves the last completed step unless saved; `interrupt_report` says what was kept."""
        self.interrupt_report = await self.run_dir.keep_on_interrupt(self.step, self.save_checkpoint)

    async def train(self) -> list[dict[str, float]]:
        """Trains from `self.step` to controller.steps; the metrics of the steps trained. A trainer
        rank's death with a restart left rebuilds the trainer and trains on from its checkpoint."""
        return await train_with_restarts(self._train_from_step, self.recover_trainer)

    async def _train_from_step(self, history: dict[int, dict[str, float]]) -> None:
        c = self.config
        resumed = self.resume or self.trainer_restarts.done > 0
        wandb = WandbSink.for_run(self.run_dir.path, c, resumed) if c.metrics.wandb_project else None
        metrics_log = MetricsLogger(self.run_dir.path, c.controller.steps, resume_step=self.step, wandb=wandb)
        self._env_errors = EnvErrorLog(self.run_dir.path, resume_step=self.step)
        evals = EvalSchedule(self.evaluator, c.controller, metrics_log.log_eval, lambda: self.weight_sync.version)
        if self.step == 0 and not self.trainer_restarts.done:
            await evals.after_step(0)  # the policy before training (kept in the records by a rebuilt trainer)
        self._generator_metrics.read(await self.meshes.router_stats(self.router))  # busy time at start: step 1 idle
        # The generators hold the policy of self.step: start() pushed the resumed one, if any.
        self.producer = RolloutProducer(self.rollouter, self.samples, c.rollout.prompts_per_step,
                                        ahead=0 if c.controller.mode == "sync" else c.controller.max_staleness,
                                        first_step=self.step + 1, last_step=c.controller.steps)
        self.producer.start()
        self.watchdog.start()  # while rollouts run: their env calls share this loop
        try:
            while self.step < c.controller.steps:
                metrics = await self._train_step(metrics_log)
                history[self.step] = metrics  # the step it completed
                evals.raise_failed()
                await evals.after_step(self.step)
            await evals.finish()
        except (SupervisionError, ProcLost) as e:
            # A proc died or stayed unresponsive (trainer or router), or the job's hosts went away:
            # stop with which, how, and where to resume from.
            cause, step = await self.meshes.cause(e), self.step + 1
            raise self.trainer_restarts.failure(cause, self.meshes.trainer_lost(),
                                                lambda why: self.run_dir.resumable(f"step {step}: {why}")) from None
        finally:
            self.watchdog.stop()
            try:
                await self.producer.stop()
            finally:
                evals.cancel()
                png = metrics_log.close(failing=sys.exc_info()[1] is not None)
        if png is not None:
            print(f"reward curve: {png}", flush=True)

    async def _train_step(self, metrics_log: MetricsLogger) -> dict[str, float]:
        c = self.config
        step = self.step + 1
        step_start = time.perf_counter()
        groups: list[RolloutGroup] = []
        while len(groups) < c.rollout.prompts_per_step:
            try:
                groups.append(await self.producer.next_group())
            except Exception as e:  # noqa: BLE001 - whatever ended the group ends the run
                raise TrainingError(f"step {step}: a rollout group failed: {e!r}") from e
        rollout_wait = time.perf_counter() - step_start
        groups.sort(key=group_number)  # the same batch whatever order the groups finished in
        # From here the step completes even when interrupted: a run stopped in the middle of an
        # update could not tell which step the trainer's weights belong to.
        return await self.meshes.finish(
            self._finish_step(step, groups, step_start, rollout_wait, metrics_log),
            f"interrupted: completing step {step}, whose update has begun (Ctrl-C again to quit at once)")

    async def _finish_step(self, step: int, groups: list[RolloutGroup], step_start: float, rollout_wait: float,
                           metrics_log: MetricsLogger) -> dict[str, float]:
        """Trains on the step's groups, checkpoints when due, pushes a new policy, logs the step."""
        c = self.config
        self._env_errors.record(step, (r for g in groups for r in g.rollouts))
        episodes, ages, stale = fresh_episodes(groups, self.policy_version, c.controller.max_staleness)

        version_before = self.policy_version
        pushing = None

        async def train() -> dict[str, float]:
            nonlocal pushing
            train_metrics, pushing = await self._train_on(episodes, step) if episodes else ({}, None)
            return train_metrics

        async def checkpoint() -> None:
            self.step = step
            if c.controller.checkpoint_due(step):
                await self.save_checkpoint()

        async def sync() -> dict[str, float]:
            if pushing is not None:
                return await self._sync_call(pushing)
            if await self.weight_sync.due(self.policy_version):
                return await self._sync_call(self.push_weights(self.policy_version))
            return {}

        update = await take_turns(self.turns, train, checkpoint, sync)
        trained = self.policy_version != version_before
        await self.producer.reached(step)
        step_s = time.perf_counter() - step_start

        metrics = step_metrics(groups, update, trained=trained, policy_version=self.policy_version, ages=ages,
                               stale=stale, step_s=step_s, rollout_wait_s=rollout_wait)
        generators = await self.meshes.router_stats(self.router)
        metrics.update(self._generator_metrics.read(generators))
        if self.gateway is not None:
            metrics.update(self.gateway.step_metrics())
        untrained = None if trained else untrained_reason(groups, episodes, stale, c.controller.max_staleness)
        if c.controller.log_samples:
            metrics_log.log_samples(step, sample_records(groups, self.tokenizer))
        metrics_log.log_step(step, metrics, groups, untrained)  # the step's records are complete with this one
        if (line := self.errored_steps.stop_line(step, groups)) is not None:
            raise TrainingError(f"{line}; {await self._save_step_once()}")
        if step < c.controller.steps and (lost := replicas_lost(generators, c.generator.restart_dead)):
            raise TrainingError(f"step {step}: {lost}; {await self._save_step_once()}; continue with --resume")
        return metrics

    async def _train_on(self, episodes: list[Episode],
                        step: int) -> tuple[dict[str, float], asyncio.Future[dict[str, float]] | None]:
        """One optimizer step on `episodes` (rlactors.run.optimizer_step): its metrics, and the push
        of the policy it made where that push went out with the step (to be awaited). A step that
        checkpoints pushes after its save, so that a push that fails stops the run with it saved."""
        with_step = self.weight_sync.pushes_with_step and not self.config.controller.checkpoint_due(step)
        push = (lambda: self.push_weights(self.policy_version + 1)) if with_step else None
        try:
            metrics, pushing, version = await optimizer_step(self.trainer, self.batcher, self.config, episodes, push,
                                                              self.meshes.teacher)
        except UpdateSkipped as skipped:
            raise TrainingError(f"step {step}: {skipped}; {await self._save_step_once()}") from None
        self.policy_version = self.policy_version if version is None else version
        return metrics, pushing

    async def _save_step_once(self) -> str:
        """Saves the current step before the run stops unless its checkpoint is complete; says where."""
        if not self.run_dir.is_saved(self.step):
            await self.save_checkpoint()
        return f"the state after step {self.step} is saved in {self.run_dir.checkpoints}"

    async def save_checkpoint(self) -> Path:
        resume = (self.producer.resume_state(self.step + 1) if self.producer is not None else
                  {"samples": self.samples.state_dict(), "rollouter": self.rollouter.state_dict()})
        return await self.run_dir.save(self.trainer, ResumeState(self.step, self.policy_version, **resume),
                                       self.config.controller.keep_checkpoints)

