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

A run dir holds one run: a new run refuses a dir with steps in it, and `--resume` refuses a config
whose env or seed differ from the run's. Ctrl-C lets a step whose update has begun complete, then
saves the last completed step unless its checkpoint exists.

With `controller.eval_every`, the policy of step 0, of every eval_every-th step and of the last step
is scored on the env's eval split (rlactors.evaluation): in sync mode before the next step's update
(so on that policy alone), in async mode beside training, which does not wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from rlactors.config import Config, ConfigError, dump_toml, read_toml
from rlactors.evaluation import Evaluator, eval_due, eval_samples
from rlactors.liveness import ProcLost, ProcWatcher, this_machine, with_descendants
from rlactors.losses import LossNorm
from rlactors.metrics import EnvErrorLog, MetricsLogger, WandbSink, check_wandb
from rlactors.placement import Hosts, NoHosts, allocate_hosts, first_value, gpu_layout, host_name
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.env import SampleStream, load_env
from rlactors.rollout.producer import RolloutProducer
from rlactors.rollout.rollouter import Rollouter, group_number, prompts_too_long_line
from rlactors.rollout.rollouter import summarize as summarize_groups
from rlactors.rollout.types import Episode, Rollout, RolloutGroup
from rlactors.trainer.checkpoint import checkpoint_dir, is_complete, latest_checkpoint
from rlactors.types import Completion, SamplingParams
from rlactors.watchdog import LoopWatchdog
from rlactors.weight_sync.sync import BroadcastStuck, NoReplicaUp, WeightSync, WeightSyncError, create_weight_sync

logger = logging.getLogger(__name__)

CONTROLLER_STATE = "controller_state.json"
# How long shutdown waits for the gateway, router and procs to stop before it kills the procs.
SHUTDOWN_WAIT_S = 60.0
# Settings a resumed run must keep: another env or seed would make it a different run.
FIXED_ON_RESUME = ("env.name", "env.args", "controller.seed")
# What to try when steps train nothing because every group's rewards are equal.
NO_SIGNAL_HINT = ("start from a policy that sometimes succeeds (a warm start in model.path), make the task easier "
                  "or its reward partial, or raise rollout.group_size or rollout.temperature")


class TrainingError(RuntimeError):
    """The run cannot go on (a dead trainer, a non-finite loss); the message says why."""


class RunComplete(Exception):
    """`--resume` of a run that has reached controller.steps: there is nothing to train."""


@dataclass
class ResumeState:
    """Where the run stands after a step: what a checkpoint needs beyond the trainer's state."""

    step: int
    policy_version: int
    samples: dict[str, int]
    rollouter: dict[str, int]


def episode_age(episode: Episode, version: int) -> int:
    """Versions between the trainer's policy and the oldest policy that generated the episode."""
    generated = [v for v in episode.versions if v >= 0]
    return version - min(generated) if generated else 0


class Controller:
    """Owns the meshes of one run. `await Controller(config).run()` trains and returns metrics."""

    def __init__(self, config: Config, resume: bool = False):
        self.config = config
        self.resume = resume
        self.run_dir = Path(config.controller.run_dir)
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.step = 0
        self.policy_version = 0  # the trainer's
        self.producer: RolloutProducer | None = None  # while train() runs
        self._env_errors: EnvErrorLog | None = None
        self._told_no_signal = False
        self.interrupt_report: str | None = None  # the line that says what Ctrl-C kept
        self._faults: list[str] = []
        self._procs: list[Any] = []
        self._replica_pids: set[int] = set()  # replicas' OS processes on this machine (_router_stats)
        self.watcher = ProcWatcher(config.controller.unresponsive_timeout_s)  # tells dead procs from slow ones
        self._hosts: Hosts | None = None
        self.hosts_lost: str | None = None  # what took the job's hosts away mid-run (a cancelled Slurm job)
        self._generator_busy: tuple[float, float] | None = None  # (time, busy seconds of all replicas)
        self.evaluator: Evaluator | None = None  # with controller.eval_every
        self._eval_tasks: dict[int, asyncio.Task] = {}  # async mode: evals running beside training
        self._metrics_log: MetricsLogger | None = None
        self.trainer = None
        self.router = None
        self.weight_sync: WeightSync | None = None
        # During training, a call that blocks the loop (an env's) is named after step_timeout_s,
        # which cannot fire then.
        self.watchdog = LoopWatchdog(after_s=config.rollout.step_timeout_s)
        self.gateway = None  # an AgentEnv's harnesses call the policy through it (rlactors.gateway)

    # -- setup --------------------------------------------------------------------------------

    async def start(self) -> None:
        import monarch.actor
        from monarch.actor import this_host

        from rlactors.actors.liveness import watch_procs
        from rlactors.actors.router import GeneratorRouter
        from rlactors.actors.trainer import spawn_trainer
        from rlactors.models import load_checked_tokenizer

        # Monarch's default for a fault nobody handled is to kill this process; record it instead,
        # so the loop can stop cleanly (the failing call raises too).
        monarch.actor.unhandled_fault_hook = self._on_unhandled_fault

        c = self.config
        resume_from = self._check_run_dir()  # fails (or finds the run complete) before any proc starts
        self.tokenizer = load_checked_tokenizer(c.model.path)
        env = load_env(c.env, self.tokenizer)
        dataset = env.dataset("train")
        if len(dataset) == 0:
            raise TrainingError(f"env {c.env.name}: the train split is empty")
        self.samples = SampleStream(dataset, seed=c.controller.seed)
        self.rollouter = Rollouter(env, self._generate, c.rollout, seed=c.controller.seed)
        too_long = await self.rollouter.prompts_too_long(dataset)
        if too_long:
            print(prompts_too_long_line(too_long, len(dataset), c.rollout.max_total_tokens), flush=True)
        if c.controller.eval_every:
            try:
                held_out = eval_samples(env, c.env.name, c.eval)
            except ConfigError as e:
                raise ConfigError(f"controller.eval_every={c.controller.eval_every}: {e}") from None
            self.evaluator = Evaluator(env, self._generate, c.rollout, c.eval, held_out)
        if c.metrics.wandb_project:
            check_wandb()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batcher = Batcher(c.batcher, dp_size=c.trainer.ranks, pad_token_id=pad_id)

        device = c.controller.device
        replica_gpus = gpu_layout(c)[1] if device == "cuda" else None
        try:
            self._hosts = await allocate_hosts(c.job, gpus=device == "cuda", log_dir=self.run_dir / "slurm")
        except NoHosts as e:
            raise TrainingError(f"job.scheduler: {e}") from None
        trainer_procs, trainer, ranks = await spawn_trainer(self._hosts.trainers, c.model, c.trainer, device,
                                                            generator_engine=c.generator.engine)
        router_procs = this_host().spawn_procs(per_host={"procs": 1})
        self._procs = [trainer_procs, router_procs]  # the router's last: on this host
        router = router_procs.spawn("router", GeneratorRouter, c.generator, c.model, replica_gpus,
                                    self._hosts.generators, c.controller.unresponsive_timeout_s)
        # Calls to a proc that exits (or stays unresponsive past the timeout) fail at once with ProcLost.
        trainer_watch = await watch_procs(self.watcher, trainer_procs, [f"trainer rank {r['rank']}" for r in ranks])
        router_watch = await watch_procs(self.watcher, router_procs, ["generator router"])
        self.trainer = self.watcher.guard(trainer, trainer_watch)
        self.router = self.watcher.guard(router, router_watch)
        await self._print_placement(ranks)
        await self._start_gateway(env)

        self.weight_sync = create_weight_sync(c, self.trainer, self.router)
        await self._sync_call(self.weight_sync.start())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_toml(c), encoding="utf-8")
        if resume_from is not None:
            await self._restore(resume_from)

    async def _print_placement(self, ranks: list[dict[str, Any]]) -> None:
        """One line: the host of each trainer rank and of each generator replica, in order."""
        stats = await self._router_stats()
        replica_hosts = [r["engine"]["host"] if r["engine"] else r["state"] for r in stats["replicas"]]
        print(f"trainer ranks on {', '.join(r['host'] for r in ranks)}; "
              f"generator replicas on {', '.join(replica_hosts)}", flush=True)

    async def _start_gateway(self, env: Any) -> None:
        """An AgentEnv's harnesses reach the policy through the gateway, served from this process
        (on the router's host), for training and evaluation alike."""
        from rlactors.gateway import serve_agent_env

        c = self.config
        self.gateway = await serve_agent_env(env, c.gateway, c.rollout.max_tokens_per_turn, self.tokenizer)
        if self.gateway is not None:
            print(f"gateway for {type(env).__name__} harnesses at {self.gateway.url}", flush=True)

    def _check_run_dir(self) -> Path | None:
        """A new run never writes over a run dir that holds steps; `--resume` continues the run in
        run_dir with its env and seed, and raises RunComplete when it has all its steps. Returns
        the checkpoint to resume from."""
        if not self.resume:
            # A dir with only config.toml (a run stopped before its first step) holds nothing to lose.
            metrics, last = self.run_dir / "metrics.jsonl", latest_checkpoint(self.checkpoint_root)
            held = (["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []) + \
                ([f"checkpoints/{last.name}"] if last else [])
            if held:
                raise TrainingError(f"controller.run_dir: {self.run_dir} already holds a run ({', '.join(held)}); "
                                    f"continue it with --resume, or give this run another controller.run_dir "
                                    f"(or delete {self.run_dir})")
            return None
        path = latest_checkpoint(self.checkpoint_root)
        if path is None:
            raise TrainingError(f"--resume: no complete checkpoint under {self.checkpoint_root}")
        if not (Path(path) / CONTROLLER_STATE).is_file():
            raise TrainingError(f"--resume: {path} has no {CONTROLLER_STATE}")
        self._check_resumed_config(Path(path))
        step = ResumeState(**json.loads((Path(path) / CONTROLLER_STATE).read_text())).step
        if step >= self.config.controller.steps:
            raise RunComplete(f"nothing to train: the run in {self.run_dir} is at step {step} and controller.steps "
                              f"is {self.config.controller.steps}; raise controller.steps to train further")
        return Path(path)

    def _check_resumed_config(self, checkpoint: Path) -> None:
        """Refuses a resume whose env or seed differ from the run's config.toml; prints the other
        settings that changed."""
        saved_file = self.run_dir / "config.toml"
        if not saved_file.is_file():
            return
        saved = _flat_config(read_toml(saved_file))
        now = _flat_config(json.loads(json.dumps(self.config.to_dict())))  # tuples as lists, like TOML's
        changed = {key: (saved[key], now[key]) for key in now if key in saved and saved[key] != now[key]}
        for key in FIXED_ON_RESUME:
            if key in changed:
                was, asked = changed[key]
                raise TrainingError(
                    f"--resume: {key} is {asked!r} here but the run in {self.run_dir} has {was!r} ({saved_file}); "
                    f"resume it as it was, or start a new run in another controller.run_dir "
                    f"(model.path=\"{checkpoint / 'hf'}\" starts from this run's policy)")
        if changed:
            print("resuming with changed settings: "
                  + "; ".join(f"{key} {was!r} -> {asked!r}" for key, (was, asked) in changed.items()), flush=True)

    async def _restore(self, path: Path) -> None:
        state = ResumeState(**json.loads((path / CONTROLLER_STATE).read_text()))
        await self.trainer.load_checkpoint.call(str(path))
        self.samples.load_state_dict(state.samples)
        self.rollouter.load_state_dict(state.rollouter)
        self.step, self.policy_version = state.step, state.policy_version
        # The generators start from model.path: give them the resumed policy before any rollout.
        await self._push_weights()
        print(f"resumed from {path} at step {self.step} (policy version {self.policy_version})", flush=True)

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

    # -- generation ---------------------------------------------------------------------------

    async def _generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                        session_id: str | None = None) -> Completion:
        return await self.router.generate.call_one(prompt_token_ids, sampling, request_id, session_id)

    # -- evaluation ---------------------------------------------------------------------------

    async def _evaluate_if_due(self, step: int) -> None:
        """Evaluates the policy of `step`, which the generators hold, when the schedule says so
        (`eval_due`). Sync mode waits for it here, before the next step's update, so every eval
        request runs on that policy (the next step's rollouts may be generated meanwhile); async
        mode lets it run beside training, and the trainer does not wait for it."""
        c = self.config
        if self.evaluator is None or not eval_due(step, c.controller.eval_every, c.controller.steps):
            return
        task = asyncio.ensure_future(self._evaluate(step))
        if c.controller.mode == "async":
            self._eval_tasks[step] = task
            return
        try:
            await task
        except Exception as e:  # noqa: BLE001 - reported as the run's error
            raise TrainingError(f"evaluation of step {step} failed: {e!r}") from e

    async def _evaluate(self, step: int) -> None:
        self._metrics_log.log_eval(step, await self.evaluator.evaluate(step, self.weight_sync.version))

    def _raise_failed_eval(self) -> None:
        """Async mode: forgets the evals that finished, and stops the run if one failed."""
        for step, task in list(self._eval_tasks.items()):
            if task.done():
                del self._eval_tasks[step]
                if task.exception() is not None:
                    raise TrainingError(f"evaluation of step {step} failed: {task.exception()!r}") from task.exception()

    async def _finish_evals(self) -> None:
        """Async mode, after the last step: waits for the evals still running (the last step's)."""
        await asyncio.gather(*self._eval_tasks.values(), return_exceptions=True)
        self._raise_failed_eval()

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
            raise TrainingError(f"{e}; {self._last_checkpoint()}") from None
        except asyncio.CancelledError:
            await self._keep_last_step()
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
        raise TrainingError(f"step {self.step + 1}: {self.hosts_lost}; {self._last_checkpoint()}; "
                            "continue with --resume")

    async def _keep_last_step(self) -> None:
        """After Ctrl-C: saves the last completed step unless its checkpoint is complete, and says
        where the run can be resumed from (or that nothing was saved)."""
        if self.step and not is_complete(checkpoint_dir(self.checkpoint_root, self.step)):
            print(f"interrupted: saving step {self.step} (Ctrl-C again to quit without saving)", file=sys.stderr,
                  flush=True)
            try:
                await self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - stopping anyway: say what was kept
                logger.error("saving step %d failed: %s", self.step, e)
        last = latest_checkpoint(self.checkpoint_root)
        if last is None:
            self.interrupt_report = (f"interrupted before step {self.step + 1} completed: nothing is saved; "
                                     "start the run again (without --resume)")
        else:
            after = f" after step {self.step}" if self.step else ""
            self.interrupt_report = f"interrupted{after}: the run is saved in {last}; continue with --resume"
        print(self.interrupt_report, file=sys.stderr, flush=True)

    async def train(self) -> list[dict[str, float]]:
        c = self.config
        wandb = None
        if c.metrics.wandb_project:
            wandb = WandbSink(self.run_dir, c.metrics.wandb_project, c.metrics.wandb_run, c.to_dict(), self.resume)
        metrics_log = self._metrics_log = MetricsLogger(self.run_dir, c.controller.steps, resume_step=self.step,
                                                        wandb=wandb)
        self._env_errors = EnvErrorLog(self.run_dir, resume_step=self.step)
        if self.step == 0:
            await self._evaluate_if_due(0)  # the policy before training
        await self._generator_metrics()  # the first reading of generator busy time, for step 1's idle fraction
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
                self._raise_failed_eval()
                await self._evaluate_if_due(self.step)
            await self._finish_evals()
        except (SupervisionError, ProcLost) as e:
            # A proc died or stayed unresponsive (trainer or router), or the job's hosts went away:
            # stop with which, how, and where to resume from.
            cause = self._hosts.lost() or await self._lost(e)
            raise TrainingError(f"step {self.step + 1}: {cause}; {self._last_checkpoint()}; "
                                "continue with --resume") from None
        finally:
            self.watchdog.stop()
            try:
                await self.producer.stop()
            finally:
                for task in self._eval_tasks.values():
                    task.cancel()
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
        sync = await self._push_weights() if self.weight_sync.version != self.policy_version else {}
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
        metrics.update(await self._generator_metrics())
        if self.gateway is not None:
            metrics.update(self.gateway.step_metrics())
        reason = None if trained else _untrained_reason(groups, episodes, stale, c.controller.max_staleness)
        metrics_log.log(step, metrics, note=reason and f"trained nothing: {reason}")
        if reason and all(g.dropped for g in groups) and not self._told_no_signal:
            self._told_no_signal = True
            print(f"step {step} trained nothing: the rollouts of each group earned equal rewards, so GRPO has "
                  f"nothing to learn from. The run goes on (later samples may differ); if no step trains, "
                  f"{NO_SIGNAL_HINT}", flush=True)
        if c.controller.log_samples:
            metrics_log.log_samples(step, self._samples(groups))
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
                                f"the state after step {self.step} is saved in {self.checkpoint_root}")
        self.policy_version = int(optim.pop("policy_version"))
        train_keys = ("grad_norm", "lr", "update_skipped")
        metrics = {(f"train/{k}" if k in train_keys else f"loss/{k}"): float(v) for k, v in optim.items()}
        metrics.update(packed.metrics)
        return metrics

    async def _push_weights(self) -> dict[str, float]:
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
                saved = f"the state after step {self.step} is saved in {self.checkpoint_root}"
            raise TrainingError(f"{e}; {saved}") from None
        except BroadcastStuck as e:  # the trainer is stuck in the collective: nothing more is saved
            raise TrainingError(f"{e}; {self._last_checkpoint()}; continue with --resume") from None
        except WeightSyncError as e:
            raise TrainingError(str(e)) from None

    def _last_checkpoint(self) -> str:
        """Where a stopped run resumes from, for its error line."""
        last = latest_checkpoint(self.checkpoint_root)
        return f"the last complete checkpoint is {last}" if last else "no checkpoint was completed"

    async def _save_step_once(self) -> None:
        """Saves the current step before the run stops, unless its checkpoint is complete already
        (saving again would rewrite a complete checkpoint)."""
        if not is_complete(checkpoint_dir(self.checkpoint_root, self.step)):
            await self.save_checkpoint()

    async def save_checkpoint(self) -> Path:
        resume = (self.producer.resume_state(self.step + 1) if self.producer is not None else
                  {"samples": self.samples.state_dict(), "rollouter": self.rollouter.state_dict()})
        state = ResumeState(self.step, self.policy_version, **resume)
        try:
            path = await self.trainer.save_checkpoint.call(str(self.checkpoint_root), self.step,
                                                           {CONTROLLER_STATE: json.dumps(state.__dict__)})
        except ActorError as e:  # the trainer could not write it (every rank raises, none is left waiting)
            reason = " ".join(f"{type(e.exception).__name__}: {e.exception}".split())
            raise TrainingError(f"saving the checkpoint of step {self.step} failed: {reason}; "
                                f"{self._last_checkpoint()}") from None
        return Path(first_value(path))

    async def _router_stats(self) -> dict[str, Any]:
        """The router's stats; notes the OS processes of the replicas that run on this machine,
        which a stuck shutdown kills (`shutdown`)."""
        stats = await self.router.stats.call_one()
        self._replica_pids |= {r["engine"]["pid"] for r in stats["replicas"]
                               if r["engine"] is not None and r["engine"]["host"] == host_name()}
        return stats

    async def _generator_metrics(self) -> dict[str, float]:
        stats = await self._router_stats()
        serving = stats["states"]["serving"]
        metrics = {"generator/serving_replicas": float(serving),
                   "generator/dead_replicas": float(stats["states"]["dead"]),
                   "generator/retries": float(stats["retries"]), "generator/restarts": float(stats["restarts"]),
                   "generator/weight_groups": float(stats["weight_groups"])}
        # Idle = the share of replica time since the last step spent outside engine steps (not
        # generating). A restarted replica's counter starts again at 0, so a step that saw a restart
        # reports nothing.
        engines = [r["engine"] for r in stats["replicas"] if r["engine"] is not None]
        # Versions a replica accepted but never loaded, because a newer one arrived first.
        metrics["generator/superseded_updates"] = float(sum(e["superseded"] for e in engines))
        now = time.perf_counter()
        busy = sum(e["busy_s"] for e in engines)
        if self._generator_busy is not None and serving:
            then, busy_then = self._generator_busy
            if busy >= busy_then:
                idle = 1.0 - (busy - busy_then) / ((now - then) * serving)
                metrics["time/generator_idle_fraction"] = min(max(idle, 0.0), 1.0)
        self._generator_busy = (now, busy)
        return metrics

    def _samples(self, groups: Sequence[RolloutGroup]) -> list[dict[str, Any]]:
        """The best and the worst rollout of each group and every one that ended in an error,
        decoded: each turn's prompt (the first whole, later ones what the env added) and
        completion, and the error's message."""
        out = []
        for group in groups:
            ranked = sorted(group.rollouts, key=lambda r: r.reward)
            chosen = {id(ranked[0]): "worst", id(ranked[-1]): "best"}
            chosen.update({id(r): "error" for r in group.rollouts if r.status.is_error and id(r) not in chosen})
            for rollout in group.rollouts:
                if id(rollout) in chosen:
                    out.append({"group": group.group_id, "rollout": rollout.index, "which": chosen[id(rollout)],
                                "reward": rollout.reward, "status": rollout.status.value, "error": rollout.error,
                                "turns": self._decoded_turns(rollout)})
        return out

    def _decoded_turns(self, rollout: Rollout) -> list[dict[str, str]]:
        if not rollout.turns and rollout.prompt_token_ids:  # a prompt that left no room to generate
            return [{"prompt": self.tokenizer.decode(rollout.prompt_token_ids), "completion": ""}]
        turns, context = [], []
        for turn in rollout.turns:
            prompt = turn.prompt_token_ids
            added = prompt[len(context):] if prompt[:len(context)] == context else prompt  # a rewrite: all of it
            turns.append({"prompt": self.tokenizer.decode(added), "completion": self.tokenizer.decode(turn.token_ids)})
            context = prompt + turn.token_ids
        return turns


def _untrained_reason(groups: Sequence[RolloutGroup], episodes: Sequence[Episode], stale: int,
                      max_staleness: int) -> str:
    """Why a step took no optimizer step, for its console line."""
    if all(g.dropped for g in groups):
        return f"equal rewards in each of its {len(groups)} groups"
    if stale and not episodes:
        return f"its {stale} episodes were all older than controller.max_staleness={max_staleness} versions"
    return "its rollouts generated no token to train on"


def _flat_config(tree: dict[str, Any]) -> dict[str, Any]:
    """`section.key` -> value of a config's sections (env.args stays one value)."""
    return {f"{section}.{key}": value for section, table in tree.items() if isinstance(table, dict)
            for key, value in table.items()}
