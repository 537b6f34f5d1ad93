"""Controller: from one Config, spawn the procs (rlactors.run.meshes) and train, one step at a time.

Sync and async training are one loop: a RolloutProducer starts each step's rollout groups once
the generators hold a recent enough policy (rlactors.rollout.producer). Each step takes
`rollout.prompts_per_step` finished groups, drops episodes older than `controller.max_staleness`
versions (counted), trains, checkpoints when due, and pushes the new weights to every replica,
verified by checksum (rlactors.weight_sync.sync; where `WeightSync.pushes_with_step`, the push goes
out with the optimizer step on a step that does not checkpoint). A step with nothing to train on (every group's
rewards equal) is a whole step all the same; its policy is the previous step's. After
`controller.max_errored_steps` steps in a row in which every rollout ended in an error, the run
stops, saved, naming the error. The run dir's layout and rules are rlactors.run.run_dir's,
evaluation's schedule rlactors.run.evaluation's. Ctrl-C lets
a step whose update has begun complete, then saves the last completed step unless it is saved. A
step after which every generator replica is dead for good (none restarting) stops the run, saved.
A dead trainer rank stops the run, or, with `controller.restart_trainer`, has the trainer rebuilt
from the last checkpoint and the steps since redone (rlactors.run.recovery).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from rlactors.config import Config
from rlactors.procs.liveness import ProcLost
from rlactors.procs.placement import first_value, placement_line
from rlactors.procs.watchdog import LoopWatchdog
from rlactors.rollout.env import OnTokens
from rlactors.rollout.producer import RolloutProducer, fresh_episodes
from rlactors.rollout.rollouter import group_number
from rlactors.rollout.types import Episode, RolloutGroup
from rlactors.run.evaluation import EvalSchedule, Evaluator
from rlactors.run.generation import generate, replicas_lost, serve_gateway
from rlactors.run.inputs import load_inputs
from rlactors.run.meshes import HostsLost, Meshes
from rlactors.run.metrics import (
    EnvErrorLog,
    GeneratorMetrics,
    MetricsLogger,
    WandbSink,
    every_rollout_failed,
    failed_steps_line,
    optimizer_metrics,
    sample_records,
    step_metrics,
    untrained_reason,
)
from rlactors.run.recovery import TrainerLost, TrainerRestarts, recovery_point
from rlactors.run.run_dir import SLURM_DIR, ResumeState, RunComplete, RunDir, TrainingError
from rlactors.run.turns import NoTurns, Turns, take_turns
from rlactors.storage.records import is_storage_fault
from rlactors.trainer.losses import LossNorm
from rlactors.types import Completion, SamplingParams
from rlactors.weight_sync.sync import BroadcastStuck, NoReplicaUp, WeightSync, WeightSyncError, create_weight_sync

logger = logging.getLogger(__name__)


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
        # During training, a call that blocks the loop (an env's) is named after step_timeout_s,
        # which cannot fire then.
        self.watchdog = LoopWatchdog(after_s=config.rollout.step_timeout_s)
        self.gateway = None  # an AgentEnv's harnesses call the policy through it (rlactors.gateway)
        self.trainer_restarts = TrainerRestarts(config.controller.restart_trainer)
        self._failed_steps = 0  # steps in a row in which every rollout ended in an error

    async def start(self) -> None:
        c = self.config
        resume_from = self.run_dir.check(c, self.resume)  # fails (or finds the run complete) before any proc starts
        inputs = await load_inputs(c, self.generate)
        self.tokenizer, self.samples, self.rollouter = inputs.tokenizer, inputs.samples, inputs.rollouter
        self.evaluator, self.batcher = inputs.evaluator, inputs.batcher

        self.trainer, self.router, ranks = await self.meshes.spawn(self.run_dir.path / SLURM_DIR)
        print(placement_line(ranks, await self.meshes.router_stats(self.router)), flush=True)
        self.gateway = await serve_gateway(inputs.env, c, self.tokenizer)

        if c.generator.sleep:
            self.turns = Turns(self.trainer, self.router)
        self.weight_sync = create_weight_sync(c, self.trainer, self.router)
        await self._sync_call(self.weight_sync.start())
        self.run_dir.write_config(c)
        # Where a trainer rebuilt before the first checkpoint starts again (rlactors.run.recovery).
        self._start_state = ResumeState(0, 0, self.samples.state_dict(), self.rollouter.state_dict())
        if resume_from is not None:
            await self._restore(resume_from, ResumeState.read(resume_from))
            print(f"resumed from {resume_from} at step {self.step} (policy version {self.policy_version})", flush=True)

    async def _restore(self, checkpoint: Path | None, state: ResumeState) -> None:
        """The trainer, the run's state and the generators' policy as `checkpoint` (None: model.path,
        which the trainer holds) holds them after `state.step`."""
        if checkpoint is not None:
            await self.trainer.load_checkpoint.call(str(checkpoint))
        self.samples.load_state_dict(state.samples)
        self.rollouter.load_state_dict(state.rollouter)
        self.step, self.policy_version = state.step, state.policy_version
        # The generators hold model.path's policy, or a later one: give them this one before any rollout.
        await self._sync_call(self.push_weights(self.policy_version))

    async def recover_trainer(self, cause: str) -> None:
        """Rebuilds the trainer after one of its ranks died (`cause`) from the last complete
        checkpoint, brings the run and the generators back to it, and says so (rlactors.run.recovery)."""
        start, lost_in = time.monotonic(), self.step + 1
        point = recovery_point(self.run_dir, self._start_state)
        # From here the run stands at the checkpoint's step: a Ctrl-C meanwhile saves nothing more.
        self.step, self.policy_version = point.state.step, point.state.policy_version
        try:
            self.trainer, _ = await self.meshes.respawn_trainer()
            self.weight_sync = create_weight_sync(self.config, self.trainer, self.router)
            await self._sync_call(self.weight_sync.start())
            await self._restore(point.checkpoint, point.state)
        except (SupervisionError, ProcLost) as e:
            raise TrainingError(self.run_dir.resumable(f"rebuilding the trainer after {cause}: "
                                                       f"{await self.meshes.cause(e)}")) from None
        print(self.trainer_restarts.recovered_line(lost_in, cause, point, time.monotonic() - start), flush=True)

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
        """The trainer's policy `version` to every replica (`WeightSync.push`): its current one, or
        the one its optimizer step under way makes (`WeightSync.pushes_with_step`); its timings."""
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

    # -- training -----------------------------------------------------------------------------

    async def run(self) -> list[dict[str, float]]:
        """Starts the meshes, trains `controller.steps` steps, shuts down; per-step metrics.

        Cancelled (the first Ctrl-C, `rlactors.train.run_controller`), it keeps the last completed
        step: saved unless its checkpoint exists; `interrupt_report` says what was kept."""
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
        """After Ctrl-C: saves the last completed step unless its checkpoint is complete, and says
        where the run resumes from (or that nothing was saved) in `interrupt_report`."""
        if self.step and not self.run_dir.is_saved(self.step):
            print(f"interrupted: saving step {self.step} (Ctrl-C again to quit without saving)", file=sys.stderr,
                  flush=True)
            try:
                await self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - stopping anyway: say what was kept
                logger.error("saving step %d failed: %s", self.step, e)
        self.interrupt_report = self.run_dir.interrupt_report(self.step)
        print(self.interrupt_report, file=sys.stderr, flush=True)

    async def train(self) -> list[dict[str, float]]:
        """Trains from `self.step` to controller.steps; the metrics of the steps trained. A trainer
        rank's death with a restart left rebuilds the trainer and trains on from its checkpoint."""
        history: dict[int, dict[str, float]] = {}  # step -> its metrics
        while True:
            try:
                await self._train_from_step(history)
                return list(history.values())
            except TrainerLost as lost:
                await self.recover_trainer(str(lost))
                for step in [s for s in history if s > self.step]:
                    del history[step]  # trained again

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
            cause = await self.meshes.cause(e)
            if self.trainer_restarts.allow(self.meshes.trainer_lost()):
                raise TrainerLost(cause) from None
            cause = self.trainer_restarts.exhausted(cause)
            raise TrainingError(self.run_dir.resumable(f"step {self.step + 1}: {cause}")) from None
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

        metrics = step_metrics(groups, update.trained, trained=trained, policy_version=self.policy_version, ages=ages,
                               stale=stale, step_s=step_s, rollout_wait_s=rollout_wait, train_s=update.seconds["train"],
                               sync=update.synced, sync_s=update.seconds["sync"],
                               checkpoint_s=update.seconds["checkpoint"])
        metrics.update(update.turns)
        generators = await self.meshes.router_stats(self.router)
        metrics.update(self._generator_metrics.read(generators))
        if self.gateway is not None:
            metrics.update(self.gateway.step_metrics())
        untrained = None if trained else untrained_reason(groups, episodes, stale, c.controller.max_staleness)
        if c.controller.log_samples:
            metrics_log.log_samples(step, sample_records(groups, self.tokenizer))
        metrics_log.log_step(step, metrics, groups, untrained)  # the step's records are complete with this one
        failed = every_rollout_failed(groups)
        self._failed_steps = self._failed_steps + 1 if failed else 0
        if failed and self._failed_steps == c.controller.max_errored_steps:
            line = failed_steps_line(step - self._failed_steps + 1, step, failed, c.controller.max_errored_steps)
            raise TrainingError(f"{line}; {await self._save_step_once()}")
        if step < c.controller.steps and (lost := replicas_lost(generators, c.generator.restart_dead)):
            raise TrainingError(f"step {step}: {lost}; {await self._save_step_once()}; continue with --resume")
        return metrics

    async def _train_on(self, episodes: list[Episode],
                        step: int) -> tuple[dict[str, float], asyncio.Future[dict[str, float]] | None]:
        """One optimizer step on `episodes`: its metrics, and the push of the policy it made where
        that push went out with the step (to be awaited)."""
        from rlactors.actors.trainer import forward_backward

        c = self.config
        packed = self.batcher.pack(episodes)
        max_tokens = c.rollout.max_tokens_per_turn * c.rollout.max_turns
        norm = LossNorm.for_step([mb for mbs in packed.per_rank for mb in mbs], c.loss.name, max_tokens)
        if norm.num_tokens == 0:
            return dict(packed.metrics), None
        await forward_backward(self.trainer, packed.per_rank, norm, c.loss, self.meshes.teacher)
        # The new policy goes out as the optimizer step ends, with no call between them. A step that
        # checkpoints pushes after its save, so that a push that fails stops the run with it saved.
        pushing = None
        if self.weight_sync.pushes_with_step and not c.controller.checkpoint_due(step):
            pushing = asyncio.ensure_future(self.push_weights(self.policy_version + 1))
        try:
            optim = first_value(await self.trainer.optim_step.call())
        except BaseException:
            _let_go(pushing)
            raise
        if not math.isfinite(optim["loss"]) or optim["update_skipped"]:
            # optim_step skipped the update (a non-finite gradient, even under a finite loss): the
            # weights are still those of the last step, and the next steps would only repeat the
            # overflow. A complete checkpoint of that state is kept as is. A push sent with the
            # step sent those weights, which every replica refused as another version: it ends
            # before the save, which reads the weights too.
            if pushing is not None:
                await asyncio.wait([pushing])
                _let_go(pushing)
            saved = await self._save_step_once()
            raise TrainingError(f"step {step}: the loss is {optim['loss']} (gradient norm {optim['grad_norm']}); "
                                f"{saved}")
        self.policy_version = int(optim.pop("policy_version"))
        return {**optimizer_metrics(optim), **packed.metrics}, pushing

    async def _save_step_once(self) -> str:
        """Saves the current step before the run stops, unless its checkpoint is complete already
        (saving again would rewrite a complete checkpoint); says where."""
        if not self.run_dir.is_saved(self.step):
            await self.save_checkpoint()
        return f"the state after step {self.step} is saved in {self.run_dir.checkpoints}"

    async def save_checkpoint(self) -> Path:
        resume = (self.producer.resume_state(self.step + 1) if self.producer is not None else
                  {"samples": self.samples.state_dict(), "rollouter": self.rollouter.state_dict()})
        return await self.run_dir.save(self.trainer, ResumeState(self.step, self.policy_version, **resume),
                                       self.config.controller.keep_checkpoints)


def _let_go(pushing: asyncio.Future | None) -> None:
    """Leaves a push that the step's failure makes moot to end by itself, its outcome unread."""
    if pushing is not None:
        pushing.add_done_callback(lambda f: f.cancelled() or f.exception())
