"""Controller: from one Config, spawn the procs (rlactors.meshes) and train, one step at a time.

Sync and async training are one loop: a RolloutProducer starts each step's rollout groups once
the generators hold a recent enough policy (rlactors.rollout.producer). Each step takes
`rollout.prompts_per_step` finished groups, drops episodes older than `controller.max_staleness`
versions (counted), trains, checkpoints when due, and pushes the new weights to every replica,
verified by checksum (rlactors.weight_sync.sync; where `WeightSync.pushes_with_step`, the push goes
out with the optimizer step on a step that does not checkpoint). A step with nothing to train on (every group's
rewards equal) is a whole step all the same; its policy is the previous step's. After
`controller.max_errored_steps` steps in a row in which every rollout ended in an error, the run
stops, saved, naming the error. The run dir's
layout and rules are rlactors.run_dir's, evaluation's schedule rlactors.evaluation's. Ctrl-C lets
a step whose update has begun complete, then saves the last completed step unless it is saved. A
step after which every generator replica is dead for good (none restarting) stops the run, saved.
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
from monarch.actor import ActorError

from rlactors.config import Config, check_model_keys
from rlactors.evaluation import EvalSchedule, Evaluator, training_evaluator
from rlactors.generation import generate, replicas_lost, serve_gateway
from rlactors.liveness import ProcLost
from rlactors.losses import LossNorm
from rlactors.meshes import HostsLost, Meshes
from rlactors.metrics import (
    EnvErrorLog,
    GeneratorMetrics,
    MetricsLogger,
    WandbSink,
    check_wandb,
    every_rollout_failed,
    failed_steps_line,
    optimizer_metrics,
    sample_records,
    step_metrics,
    untrained_reason,
)
from rlactors.placement import first_value, placement_line
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.env import OnTokens, SampleStream, load_env
from rlactors.rollout.producer import RolloutProducer, fresh_episodes
from rlactors.rollout.rollouter import Rollouter, group_number, prompts_too_long_line
from rlactors.rollout.types import Episode, RolloutGroup
from rlactors.run_dir import SLURM_DIR, ResumeState, RunComplete, RunDir, TrainingError
from rlactors.types import Completion, SamplingParams
from rlactors.watchdog import LoopWatchdog
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
        self.evaluator: Evaluator | None = None  # with controller.eval_every (rlactors.evaluation)
        self.trainer = self.router = None  # guarded by the meshes' watcher
        self.weight_sync: WeightSync | None = None
        # During training, a call that blocks the loop (an env's) is named after step_timeout_s,
        # which cannot fire then.
        self.watchdog = LoopWatchdog(after_s=config.rollout.step_timeout_s)
        self.gateway = None  # an AgentEnv's harnesses call the policy through it (rlactors.gateway)
        self._failed_steps = 0  # steps in a row in which every rollout ended in an error

    async def start(self) -> None:
        from rlactors.models import load_checked_tokenizer
        from rlactors.models.checkpoint import load_args

        c = self.config
        resume_from = self.run_dir.check(c, self.resume)  # fails (or finds the run complete) before any proc starts
        self.tokenizer = load_checked_tokenizer(c.model.path)
        check_model_keys(c.model, c.trainer, load_args(c.model.path))
        env = load_env(c.env, self.tokenizer)
        dataset = env.dataset("train")
        if len(dataset) == 0:
            raise TrainingError(f"env {c.env.name}: the train split is empty")
        self.samples = SampleStream(dataset, seed=c.controller.seed)
        self.rollouter = Rollouter(env, self.generate, c.rollout, seed=c.controller.seed)
        too_long = await self.rollouter.prompts_too_long(dataset)
        if too_long:
            print(prompts_too_long_line(too_long, len(dataset), c.rollout.max_total_tokens), flush=True)
        self.evaluator = training_evaluator(env, c, self.generate)
        if c.metrics.wandb_project:
            check_wandb()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batcher = Batcher(c.batcher, dp_size=c.trainer.ranks, pad_token_id=pad_id)

        self.trainer, self.router, ranks = await self.meshes.spawn(self.run_dir.path / SLURM_DIR)
        print(placement_line(ranks, await self.meshes.router_stats(self.router)), flush=True)
        self.gateway = await serve_gateway(env, c, self.tokenizer)

        self.weight_sync = create_weight_sync(c, self.trainer, self.router)
        await self._sync_call(self.weight_sync.start())
        self.run_dir.write_config(c)
        if resume_from is not None:
            state = ResumeState.read(resume_from)
            await self.trainer.load_checkpoint.call(str(resume_from))
            self.samples.load_state_dict(state.samples)
            self.rollouter.load_state_dict(state.rollouter)
            self.step, self.policy_version = state.step, state.policy_version
            # The generators start from model.path: give them the resumed policy before any rollout.
            await self._sync_call(self.push_weights(self.policy_version))
            print(f"resumed from {resume_from} at step {self.step} (policy version {self.policy_version})", flush=True)

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
        c = self.config
        wandb = WandbSink.for_run(self.run_dir.path, c, self.resume) if c.metrics.wandb_project else None
        metrics_log = MetricsLogger(self.run_dir.path, c.controller.steps, resume_step=self.step, wandb=wandb)
        self._env_errors = EnvErrorLog(self.run_dir.path, resume_step=self.step)
        evals = EvalSchedule(self.evaluator, c.controller, metrics_log.log_eval, lambda: self.weight_sync.version)
        if self.step == 0:
            await evals.after_step(0)  # the policy before training
        self._generator_metrics.read(await self.meshes.router_stats(self.router))  # busy time at start: step 1 idle
        # The generators hold the policy of self.step: start() pushed the resumed one, if any.
        self.producer = RolloutProducer(self.rollouter, self.samples, c.rollout.prompts_per_step,
                                        ahead=0 if c.controller.mode == "sync" else c.controller.max_staleness,
                                        first_step=self.step + 1, last_step=c.controller.steps)
        self.producer.start()
        self.watchdog.start()  # while rollouts run: their env calls share this loop
        history = []
        try:
            while self.step < c.controller.steps:
                history.append(await self._train_step(metrics_log))
                evals.raise_failed()
                await evals.after_step(self.step)
            await evals.finish()
        except (SupervisionError, ProcLost) as e:
            # A proc died or stayed unresponsive (trainer or router), or the job's hosts went away:
            # stop with which, how, and where to resume from.
            cause = await self.meshes.cause(e)
            raise TrainingError(self.run_dir.resumable(f"step {self.step + 1}: {cause}")) from None
        finally:
            self.watchdog.stop()
            try:
                await self.producer.stop()
            finally:
                evals.cancel()
                png = metrics_log.close()
        if png is not None:
            print(f"reward curve: {png}", flush=True)
        return history

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
        finish = asyncio.ensure_future(self._finish_step(step, groups, step_start, rollout_wait, metrics_log))
        try:
            return await asyncio.shield(finish)
        except asyncio.CancelledError:
            if not finish.done():
                if self.meshes.hosts_lost:  # the step cannot complete: its trainer and generators are gone
                    finish.cancel()
                    raise
                print(f"interrupted: completing step {step}, whose update has begun (Ctrl-C again to quit at once)",
                      file=sys.stderr, flush=True)
                await finish
            raise

    async def _finish_step(self, step: int, groups: list[RolloutGroup], step_start: float, rollout_wait: float,
                           metrics_log: MetricsLogger) -> dict[str, float]:
        """Trains on the step's groups, checkpoints when due, pushes a new policy, logs the step."""
        c = self.config
        self._env_errors.record(step, (r for g in groups for r in g.rollouts))
        episodes, ages, stale = fresh_episodes(groups, self.policy_version, c.controller.max_staleness)

        train_start = time.perf_counter()
        version_before = self.policy_version
        train_metrics, pushing = await self._train_on(episodes, step) if episodes else ({}, None)
        trained = self.policy_version != version_before
        train_s = time.perf_counter() - train_start

        self.step = step
        checkpoint_s = 0.0
        if c.controller.checkpoint_due(step):
            checkpoint_start = time.perf_counter()
            await self.save_checkpoint()
            checkpoint_s = time.perf_counter() - checkpoint_start

        sync_start = time.perf_counter()
        if pushing is not None:
            sync = await self._sync_call(pushing)
        elif await self.weight_sync.due(self.policy_version):
            sync = await self._sync_call(self.push_weights(self.policy_version))
        else:
            sync = {}
        sync_s = time.perf_counter() - sync_start
        await self.producer.reached(step)
        step_s = time.perf_counter() - step_start

        metrics = step_metrics(groups, train_metrics, trained=trained, policy_version=self.policy_version, ages=ages,
                               stale=stale, step_s=step_s, rollout_wait_s=rollout_wait, train_s=train_s, sync=sync,
                               sync_s=sync_s, checkpoint_s=checkpoint_s)
        generators = await self.meshes.router_stats(self.router)
        metrics.update(self._generator_metrics.read(generators))
        if self.gateway is not None:
            metrics.update(self.gateway.step_metrics())
        untrained = None if trained else untrained_reason(groups, episodes, stale, c.controller.max_staleness)
        metrics_log.log_step(step, metrics, groups, untrained)
        if c.controller.log_samples:
            metrics_log.log_samples(step, sample_records(groups, self.tokenizer))
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
        await forward_backward(self.trainer, packed.per_rank, norm, c.loss)
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
        state = ResumeState(self.step, self.policy_version, **resume)
        try:
            path = await self.trainer.save_checkpoint.call(str(self.run_dir.checkpoints), self.step, state.files())
        except ActorError as e:  # the trainer could not write it (every rank raises, none is left waiting)
            reason = " ".join(f"{type(e.exception).__name__}: {e.exception}".split())
            raise TrainingError(f"saving the checkpoint of step {self.step} failed: {reason}; "
                                f"{self.run_dir.last_checkpoint()}") from None
        return Path(first_value(path))


def _let_go(pushing: asyncio.Future | None) -> None:
    """Leaves a push that the step's failure makes moot to end by itself, its outcome unread."""
    if pushing is not None:
        pushing.add_done_callback(lambda f: f.cancelled() or f.exception())
