"""Controller: from one Config, spawn the trainer mesh and the generator router, and train.

Sync and async training are one loop. A RolloutProducer starts the rollout groups of step `s`
once the generators hold the policy of step `s - 1 - ahead`, where `ahead` is 0 in sync mode
(every token of step `s` comes from the policy of step `s - 1`) and `controller.max_staleness` in
async mode (generation runs up to that many steps ahead of the trainer and never waits for a step
to finish); its tasks end with the loop. The trainer takes `rollout.prompts_per_step` finished
groups per step, drops episodes older than `max_staleness` versions (counted), trains, and pushes
the new weights to every replica, verified by checksum (`rlactors.weight_sync.sync`). A step with
nothing to train on (every group's rewards equal) is a whole step all the same: logged, counted,
checkpointed when due; its policy is the previous step's, which the generators hold already.

The run dir's layout and its new-run and resume rules are rlactors.run_dir's; evaluation's
schedule is rlactors.evaluation's (EvalSchedule). Ctrl-C lets a step whose update has begun
complete, then saves the last completed step unless its checkpoint exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from rlactors.config import Config, ConfigError
from rlactors.evaluation import EvalSchedule, Evaluator, eval_samples
from rlactors.generation import generate, serve_gateway, spawn_router
from rlactors.liveness import ProcLost, ProcWatcher, this_machine, with_descendants
from rlactors.losses import LossNorm
from rlactors.metrics import (
    EnvErrorLog,
    GeneratorMetrics,
    MetricsLogger,
    WandbSink,
    check_wandb,
    no_signal_line,
    sample_records,
    untrained_reason,
)
from rlactors.placement import Hosts, NoHosts, allocate_hosts, first_value, host_name, placement_line
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.env import SampleStream, load_env
from rlactors.rollout.producer import RolloutProducer
from rlactors.rollout.rollouter import Rollouter, group_number, prompts_too_long_line
from rlactors.rollout.rollouter import summarize as summarize_groups
from rlactors.rollout.types import Episode, RolloutGroup
from rlactors.run_dir import SLURM_DIR, ResumeState, RunComplete, RunDir, TrainingError
from rlactors.types import Completion, SamplingParams
from rlactors.watchdog import LoopWatchdog
from rlactors.weight_sync.sync import BroadcastStuck, NoReplicaUp, WeightSync, WeightSyncError, create_weight_sync

logger = logging.getLogger(__name__)

# How long shutdown waits for the gateway, router and procs to stop before it kills the procs.
SHUTDOWN_WAIT_S = 60.0


def episode_age(episode: Episode, version: int) -> int:
    """Versions between the trainer's policy and the oldest policy that generated the episode."""
    generated = [v for v in episode.versions if v >= 0]
    return version - min(generated) if generated else 0


class Controller:
    """Owns the meshes of one run. `await Controller(config).run()` trains and returns metrics."""

    def __init__(self, config: Config, resume: bool = False):
        self.config = config
        self.resume = resume
        self.run_dir = RunDir(config.controller.run_dir)
        self.step = 0
        self.policy_version = 0  # the trainer's
        self.producer: RolloutProducer | None = None  # while train() runs
        self._told_no_signal = False
        self.interrupt_report: str | None = None  # the line that says what Ctrl-C kept
        self._faults: list[str] = []
        self._procs: list[Any] = []
        self._replica_pids: set[int] = set()  # replicas' OS processes on this machine (_router_stats)
        self.watcher = ProcWatcher(config.controller.unresponsive_timeout_s)  # tells dead procs from slow ones
        self._hosts: Hosts | None = None
        self.hosts_lost: str | None = None  # what took the job's hosts away mid-run (a cancelled Slurm job)
        self._generator_metrics = GeneratorMetrics()
        self.evaluator: Evaluator | None = None  # with controller.eval_every
        self.trainer = None
        self.router = None
        self.weight_sync: WeightSync | None = None
        # During training, a call that blocks the loop (an env's) is named after step_timeout_s,
        # which cannot fire then.
        self.watchdog = LoopWatchdog(after_s=config.rollout.step_timeout_s)
        self.gateway = None  # an AgentEnv's harnesses call the policy through it (rlactors.gateway)

    # -- setup and shutdown -------------------------------------------------------------------

    async def start(self) -> None:
        import monarch.actor

        from rlactors.actors.liveness import watch_procs
        from rlactors.actors.trainer import spawn_trainer
        from rlactors.models import load_checked_tokenizer

        # Monarch's default for a fault nobody handled is to kill this process; record it instead,
        # so the loop can stop cleanly (the failing call raises too).
        monarch.actor.unhandled_fault_hook = self._on_unhandled_fault

        c = self.config
        resume_from = self.run_dir.check(c, self.resume)  # fails (or finds the run complete) before any proc starts
        self.tokenizer = load_checked_tokenizer(c.model.path)
        env = load_env(c.env, self.tokenizer)
        dataset = env.dataset("train")
        if len(dataset) == 0:
            raise TrainingError(f"env {c.env.name}: the train split is empty")
        self.samples = SampleStream(dataset, seed=c.controller.seed)
        self.rollouter = Rollouter(env, self.generate, c.rollout, seed=c.controller.seed)
        too_long = await self.rollouter.prompts_too_long(dataset)
        if too_long:
            print(prompts_too_long_line(too_long, len(dataset), c.rollout.max_total_tokens), flush=True)
        if c.controller.eval_every:
            try:
                held_out = eval_samples(env, c.env.name, c.eval)
            except ConfigError as e:
                raise ConfigError(f"controller.eval_every={c.controller.eval_every}: {e}") from None
            self.evaluator = Evaluator(env, self.generate, c.rollout, c.eval, held_out)
        if c.metrics.wandb_project:
            check_wandb()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batcher = Batcher(c.batcher, dp_size=c.trainer.ranks, pad_token_id=pad_id)

        device = c.controller.device
        try:
            self._hosts = await allocate_hosts(c.job, gpus=device == "cuda", log_dir=self.run_dir.path / SLURM_DIR)
        except NoHosts as e:
            raise TrainingError(f"job.scheduler: {e}") from None
        trainer_procs, trainer, ranks = await spawn_trainer(self._hosts.trainers, c.model, c.trainer, device,
                                                            generator_engine=c.generator.engine)
        router_procs, router = spawn_router(c, self._hosts.generators)
        self._procs = [trainer_procs, router_procs]  # the router's last: on this host
        # Calls to a proc that exits (or stays unresponsive past the timeout) fail at once with ProcLost.
        trainer_watch = await watch_procs(self.watcher, trainer_procs, [f"trainer rank {r['rank']}" for r in ranks])
        router_watch = await watch_procs(self.watcher, router_procs, ["generator router"])
        self.trainer = self.watcher.guard(trainer, trainer_watch)
        self.router = self.watcher.guard(router, router_watch)
        print(placement_line(ranks, await self._router_stats()), flush=True)
        self.gateway = await serve_gateway(env, c, self.tokenizer)
        if self.gateway is not None:
            print(f"gateway for {type(env).__name__} harnesses at {self.gateway.url}", flush=True)

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
            await self.push_weights()
            print(f"resumed from {resume_from} at step {self.step} (policy version {self.policy_version})", flush=True)

    async def shutdown(self) -> None:
        """Stops the gateway, the router and the procs. A proc still inside a call that does not
        return (a collective whose peer died, say) is killed after SHUTDOWN_WAIT_S, with every
        process under it (the replicas' procs), so that the run's last line is never held back
        by its own shutdown."""
        local = [(p.label, p.pid) for p in self.watcher.procs if p.pid is not None and p.machine == this_machine()]
        self.watcher.close()  # the procs' exits are expected from here on
        try:
            await asyncio.wait_for(self._stop(), SHUTDOWN_WAIT_S)
        except TimeoutError:
            for pid in with_descendants([pid for _, pid in local] + sorted(self._replica_pids)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = [label for label, _ in local] + [f"replica pid {pid}" for pid in sorted(self._replica_pids)]
            print(f"warning: the procs did not stop within {SHUTDOWN_WAIT_S:.0f} s; killed "
                  f"{', '.join(killed) or 'none (none of them runs on this machine)'}", file=sys.stderr, flush=True)
        finally:
            self.release_hosts()

    def release_hosts(self) -> None:
        """Ends the job's worker processes or its Slurm allocation (idempotent); also called by a
        second Ctrl-C, which quits without a shutdown."""
        if self._hosts is not None:
            self._hosts.release()

    async def _stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        # Once the job's hosts are lost nothing on them answers, and a call there would wait for
        # Monarch's timeouts: then only the procs on this host (the router's) are stopped.
        if self.router is not None and not self.hosts_lost:
            try:
                await self.router.close.call_one()
            except Exception as e:  # noqa: BLE001 - shutting down: report and go on
                logger.warning("router close failed: %s", e)
        for procs in self._procs[-1:] if self.hosts_lost else self._procs:
            try:
                await procs.stop()
            except Exception as e:  # noqa: BLE001
                logger.warning("stopping procs failed: %s", e)

    async def _lost(self, error: BaseException) -> str:
        """What was lost: the watcher's verdict ("trainer rank 0 (pid 7) exited (signal 9)"), which
        Monarch's own SupervisionError may precede by a moment; else Monarch's words."""
        if isinstance(error, ProcLost):
            return str(error)
        watched = self.watcher.procs
        if watched:
            await asyncio.wait([p.verdict for p in watched], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        return self.watcher.lost(*watched) or " ".join(str(error).split())

    def _on_unhandled_fault(self, failure: Any) -> None:
        self._faults.append(str(failure))
        logger.error("unhandled Monarch fault: %s", failure)

    async def _router_stats(self) -> dict[str, Any]:
        """The router's stats; notes the OS processes of the replicas that run on this machine,
        which a stuck shutdown kills (`shutdown`)."""
        stats = await self.router.stats.call_one()
        self._replica_pids |= {r["engine"]["pid"] for r in stats["replicas"]
                               if r["engine"] is not None and r["engine"]["host"] == host_name()}
        return stats

    # -- the generators -----------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                       session_id: str | None = None) -> Completion:
        """One completion from the router: what the rollouts and evaluations call."""
        return await generate(self.router, prompt_token_ids, sampling, request_id, session_id)

    async def push_weights(self) -> dict[str, float]:
        """The trainer's current policy to every replica (`WeightSync.push`); its timings."""
        return await self._sync_call(self.weight_sync.push())

    async def _sync_call(self, call: Awaitable[Any]) -> Any:
        """`call` (a WeightSync step), its failure as the TrainingError that stops the run."""
        try:
            return await call
        except NoReplicaUp as e:
            saved = "no step was trained yet"
            if self.step:
                await self._save_step_once()
                saved = f"the state after step {self.step} is saved in {self.run_dir.checkpoints}"
            raise TrainingError(f"{e}; {saved}") from None
        except BroadcastStuck as e:  # the trainer is stuck in the collective: nothing more is saved
            raise TrainingError(f"{e}; {self.run_dir.last_checkpoint()}; continue with --resume") from None
        except WeightSyncError as e:
            raise TrainingError(str(e)) from None

    # -- training -----------------------------------------------------------------------------

    async def run(self) -> list[dict[str, float]]:
        """Starts the meshes, trains `controller.steps` steps, shuts down; per-step metrics.

        Cancelled (the first Ctrl-C, `rlactors.train.run_controller`), it keeps the last completed
        step: saved unless its checkpoint exists; `interrupt_report` says what was kept."""
        try:
            await self.start()
            return await self._while_hosts_hold(self.train())
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

    async def _while_hosts_hold(self, training: Awaitable[list[dict[str, float]]]) -> list[dict[str, float]]:
        """Runs `training`, but stops the run as soon as the job's hosts are gone (its Slurm job
        cancelled or out of time): Monarch would notice only when its calls to them time out."""
        train = asyncio.ensure_future(training)
        lost = asyncio.ensure_future(self._hosts.wait_lost())
        try:
            await asyncio.wait({train, lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # Ctrl-C: training ends as it would alone (its step completes)
            train.cancel()
            return await train
        finally:
            lost.cancel()
        if train.done():
            return train.result()
        self.hosts_lost = lost.result()
        train.cancel()
        await asyncio.wait({train})
        raise TrainingError(f"step {self.step + 1}: {self.hosts_lost}; {self.run_dir.last_checkpoint()}; "
                            "continue with --resume")

    async def keep_last_step(self) -> None:
        """What an interrupted run does (Ctrl-C): saves the last completed step unless its
        checkpoint is complete, and says where the run can be resumed from (or that nothing was
        saved) in `interrupt_report`."""
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
        wandb = None
        if c.metrics.wandb_project:
            wandb = WandbSink(self.run_dir.path, c.metrics.wandb_project, c.metrics.wandb_run, c.to_dict(), self.resume)
        metrics_log = MetricsLogger(self.run_dir.path, c.controller.steps, resume_step=self.step, wandb=wandb)
        self._env_errors = EnvErrorLog(self.run_dir.path, resume_step=self.step)
        evals = EvalSchedule(self.evaluator, c.controller, metrics_log.log_eval)
        if self.step == 0:
            await evals.after_step(0, self.weight_sync.version)  # the policy before training
        self._generator_metrics.read(await self._router_stats())  # the first reading of busy time, for step 1
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
                await evals.after_step(self.step, self.weight_sync.version)
            await evals.finish()
        except (SupervisionError, ProcLost) as e:
            # A proc died or stayed unresponsive (trainer or router), or the job's hosts went away:
            # stop with which, how, and where to resume from.
            cause = self._hosts.lost() or await self._lost(e)
            raise TrainingError(f"step {self.step + 1}: {cause}; {self.run_dir.last_checkpoint()}; "
                                "continue with --resume") from None
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
                if self.hosts_lost:  # the step cannot complete: its trainer and generators are gone
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
        episodes, ages, stale = [], [], 0
        for group in groups:
            for episode in group.episodes:
                age = episode_age(episode, self.policy_version)
                if age > c.controller.max_staleness:
                    stale += 1
                    continue
                episodes.append(episode)
                ages.append(age)

        train_start = time.perf_counter()
        version_before = self.policy_version
        train_metrics = await self._train_on(episodes, step) if episodes else {}
        trained = self.policy_version != version_before
        train_s = time.perf_counter() - train_start

        self.step = step
        checkpoint_s = 0.0
        every = c.controller.checkpoint_every
        if (every and step % every == 0) or step == c.controller.steps:
            checkpoint_start = time.perf_counter()
            await self.save_checkpoint()
            checkpoint_s = time.perf_counter() - checkpoint_start

        sync_start = time.perf_counter()
        sync = await self.push_weights() if self.weight_sync.version != self.policy_version else {}
        sync_s = time.perf_counter() - sync_start
        await self.producer.reached(step)
        step_s = time.perf_counter() - step_start

        generated = sum(r.num_generated_tokens for g in groups for r in g.rollouts)
        metrics = {
            **summarize_groups(groups),
            **train_metrics,
            "train/trained": float(trained),
            "policy/version": float(self.policy_version),
            "policy/age_mean": sum(ages) / len(ages) if ages else 0.0,
            "policy/age_max": float(max(ages, default=0)),
            "policy/stale_episodes_dropped": float(stale),
            "time/step_s": step_s,
            "time/rollout_wait_s": rollout_wait,
            "time/train_s": train_s,
            "time/weight_sync_s": sync_s,
            **{f"weight_sync/{k}": v for k, v in sync.items()},
            "time/checkpoint_s": checkpoint_s,
            "time/trainer_idle_fraction": rollout_wait / step_s if step_s else 0.0,
            "throughput/generated_tokens_per_s": generated / step_s if step_s else 0.0,
        }
        if "batcher/tokens" in train_metrics and train_s:
            metrics["throughput/trained_tokens_per_s"] = train_metrics["batcher/tokens"] / train_s
        metrics.update(self._generator_metrics.read(await self._router_stats()))
        if self.gateway is not None:
            metrics.update(self.gateway.step_metrics())
        reason = None if trained else untrained_reason(groups, episodes, stale, c.controller.max_staleness)
        metrics_log.log(step, metrics, note=reason and f"trained nothing: {reason}")
        if reason and all(g.dropped for g in groups) and not self._told_no_signal:
            self._told_no_signal = True
            print(no_signal_line(step), flush=True)
        if c.controller.log_samples:
            metrics_log.log_samples(step, sample_records(groups, self.tokenizer))
        return metrics

    async def _train_on(self, episodes: list[Episode], step: int) -> dict[str, float]:
        c = self.config
        packed = self.batcher.pack(episodes)
        max_tokens = c.rollout.max_tokens_per_turn * c.rollout.max_turns
        norm = LossNorm.for_step([mb for mbs in packed.per_rank for mb in mbs], c.loss.name, max_tokens)
        if norm.num_tokens == 0:
            return dict(packed.metrics)
        # Sent together: an actor serves its calls in order, and the trainer never waits for the host.
        await asyncio.gather(*(self.trainer.forward_backward.call([mbs[j] for mbs in packed.per_rank], norm, c.loss)
                               for j in range(len(packed.per_rank[0]))))
        # optim_step reduces the step's loss stats over every rank and microbatch.
        optim = first_value(await self.trainer.optim_step.call())
        if not math.isfinite(optim["loss"]) or optim["update_skipped"]:
            # optim_step skipped the update (a non-finite gradient, even under a finite loss): the
            # weights are still those of the last step, and the next steps would only repeat the
            # overflow. A complete checkpoint of that state is kept as is.
            await self._save_step_once()
            raise TrainingError(f"step {step}: the loss is {optim['loss']} (gradient norm {optim['grad_norm']}); "
                                f"the state after step {self.step} is saved in {self.run_dir.checkpoints}")
        self.policy_version = int(optim.pop("policy_version"))
        train_keys = ("grad_norm", "lr", "update_skipped")
        metrics = {(f"train/{k}" if k in train_keys else f"loss/{k}"): float(v) for k, v in optim.items()}
        metrics.update(packed.metrics)
        return metrics

    async def _save_step_once(self) -> None:
        """Saves the current step before the run stops, unless its checkpoint is complete already
        (saving again would rewrite a complete checkpoint)."""
        if not self.run_dir.is_saved(self.step):
            await self.save_checkpoint()

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
