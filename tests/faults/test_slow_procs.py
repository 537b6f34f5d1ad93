"""Slow is not dead (rlactors.procs.liveness), with real Monarch procs on CPU: a trainer proc or a
generator replica SIGSTOPped for 8 s is slow, and the run completes (the trainer's losses those
of an undisturbed run; no replica restarted); a proc SIGKILLed while it was stopped, which
Monarch's own state queries would take minutes to see, is found dead within seconds, by its exit
status; a whole CPU demo run, its procs placed, completes on a 3x oversubscribed machine."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import pytest
from faultkit import CliProcess, Spinners, small_run_overrides, wait_until
from support.linux import PIDFD_KEEPS_EXIT_STATUS, running

import rlactors.run.meshes as meshes_module
from rlactors.config import load_config
from rlactors.procs.liveness import describe_wait_status
from rlactors.run.controller import Controller, TrainingError
from rlactors.run.metrics import read_metrics

STOPPED_S = 8.0
COMPARED = ("loss/loss", "loss/tokens", "train/grad_norm", "loss/entropy/mean", "rollout/reward_mean")
# On-policy GRPO's loss is about 0 (its advantages have mean 0 in each group): two identical runs
# differ by summation noise there (1e-7), so the gradient norms carry the comparison (rel 1e-5).
ABS = 1e-6
# Detection of a proc killed while stopped: the bound for a SIGKILL, on a busy machine.
DETECTED_WITHIN_S = 3.0


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _trainer_pid(controller: Controller) -> int:
    return next(p.pid for p in controller.meshes.watcher.procs if p.name == "trainer rank 0")


@pytest.fixture(scope="module")
def undisturbed(tiny_ckpt, tmp_path_factory):
    """The step metrics of an undisturbed 3-step run."""
    run_dir = tmp_path_factory.mktemp("undisturbed")
    return asyncio.run(Controller(load_config(None, small_run_overrides(tiny_ckpt, run_dir))).run())


class TrainerStoppedInStep2(Controller):
    """SIGSTOPs the trainer proc as step 2's update begins, and SIGCONTs it STOPPED_S later."""

    async def _train_on(self, episodes, step):
        if step == 2:
            pid = self.stopped_pid = _trainer_pid(self)
            os.kill(pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(STOPPED_S, _continue, pid)
        return await super()._train_on(episodes, step)


def test_a_trainer_stopped_for_8s_is_slow_not_dead_and_the_run_matches_an_undisturbed_one(
        tiny_ckpt, tmp_path, undisturbed, caplog, fault_record):
    controller = TrainerStoppedInStep2(load_config(None, small_run_overrides(tiny_ckpt, tmp_path)))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlactors.procs.liveness"):
        try:
            metrics = asyncio.run(controller.run())
        finally:
            _continue(getattr(controller, "stopped_pid", 0) or os.getpid())
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]
    for ours, theirs in zip(metrics, undisturbed):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=ABS), key
    label = f"trainer rank 0 (pid {controller.stopped_pid})"
    said = [r.getMessage() for r in caplog.records]
    # (Monarch prefixes the actor to log lines of this process.)
    assert any(f"{label} unresponsive for " in line for line in said), said
    assert any(f"{label} answers again after " in line for line in said), said
    assert not any("exited" in line or "likely crashed" in line for line in said), said
    assert metrics[1]["time/train_s"] >= STOPPED_S - 0.5
    fault_record("trainer proc stopped (slow, not dead)", f"SIGSTOP of the trainer proc as step 2's update began, "
                 f"SIGCONT {STOPPED_S:g} s later", None, "nothing: logged as unresponsive, then answering again; "
                 "the run completed with the losses of an undisturbed run (rel 1e-5)",
                 run_s=time.monotonic() - start, step2_train_s=metrics[1]["time/train_s"])


class TrainerStoppedForGood(Controller):
    """SIGSTOPs the trainer proc as step 2's update begins, for good."""

    async def _train_on(self, episodes, step):
        if step == 2:
            self.stopped_pid = _trainer_pid(self)
            os.kill(self.stopped_pid, signal.SIGSTOP)
            self.stopped_at = time.monotonic()
        return await super()._train_on(episodes, step)


def test_a_trainer_unresponsive_past_the_timeout_stops_the_run_saying_so(tiny_ckpt, tmp_path, fault_record):
    timeout_s = 10
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path,
                                                   f"controller.unresponsive_timeout_s={timeout_s}"))
    controller = TrainerStoppedForGood(config)
    try:
        with pytest.raises(TrainingError) as raised:
            asyncio.run(asyncio.wait_for(controller.run(), 120))
        stopped_s = time.monotonic() - controller.stopped_at
    finally:
        if getattr(controller, "stopped_pid", None):
            try:
                os.kill(controller.stopped_pid, signal.SIGKILL)  # if the shutdown left it
            except ProcessLookupError:
                pass
    message = str(raised.value)
    assert re.match(re.escape(f"step 2: trainer rank 0 (pid {controller.stopped_pid}) unresponsive for ") +
                    r"1\d s \(alive, but no answer within controller.unresponsive_timeout_s=10\); the last complete "
                    r"checkpoint is .*step_00000001; continue with --resume$", message), message
    assert stopped_s >= timeout_s
    fault_record("trainer proc unresponsive past the timeout", f"SIGSTOP of the trainer proc as step 2's update began, "
                 f"never continued (controller.unresponsive_timeout_s={timeout_s})", None,
                 f"step 2's update: the run stopped with `{message.split(';')[0]}`", controller_exit_s=stopped_s)


class ReplicaStoppedInStep2(Controller):
    """SIGSTOPs generator replica 1 at step 2's first request, and SIGCONTs it STOPPED_S later;
    records the router's stats at the end."""

    stopped_pid = None

    async def generate(self, prompt_token_ids, sampling, request_id, session_id=None):
        if self.stopped_pid is None and request_id.startswith("g2/"):
            stats = await self.router.stats.call_one()
            self.stopped_pid = stats["replicas"][1]["engine"]["pid"]
            os.kill(self.stopped_pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(STOPPED_S, _continue, self.stopped_pid)
        return await super().generate(prompt_token_ids, sampling, request_id, session_id)

    async def shutdown(self):
        if self.router is not None:
            self.router_stats = await self.router.stats.call_one()
        await super().shutdown()


def test_a_replica_stopped_for_8s_is_slow_not_dead_and_nothing_restarts(tiny_ckpt, tmp_path, fault_record):
    config = load_config(None, small_run_overrides(tiny_ckpt, tmp_path, "generator.replicas=2",
                                                   "rollout.group_size=4"))
    controller = ReplicaStoppedInStep2(config)
    try:
        metrics = asyncio.run(controller.run())
    finally:
        if controller.stopped_pid:
            _continue(controller.stopped_pid)
    assert controller.stopped_pid is not None
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]
    stats = controller.router_stats
    assert stats["deaths"] == 0 and stats["restarts"] == 0 and stats["retries"] == 0, stats
    assert [(r["state"], r["slow"], r["engine"]["pid"]) for r in stats["replicas"]][1] == \
        ("serving", False, controller.stopped_pid)
    assert all(m["generator/serving_replicas"] == 2 and m["generator/restarts"] == 0 for m in metrics)
    fault_record("generator replica stopped (slow, not dead)", f"SIGSTOP of replica 1's proc at step 2's first "
                 f"request, SIGCONT {STOPPED_S:g} s later (2 replicas)", None,
                 "nothing: no death, no restart, no retry; the run completed with both replicas serving")


class TrainerKilledWhileStopped(Controller):
    """SIGSTOPs the trainer proc as step 2's update begins and SIGKILLs it 2 s later: Monarch's
    state query to it is then in flight, and Monarch alone would wait for it (minutes)."""

    async def _train_on(self, episodes, step):
        if step == 2:
            pid = self.killed_pid = _trainer_pid(self)
            os.kill(pid, signal.SIGSTOP)
            loop = asyncio.get_running_loop()

            def kill():
                os.kill(pid, signal.SIGKILL)
                self.killed_at, self.killed_at_wall = time.monotonic(), time.time()

            loop.call_later(2.0, kill)
        return await super()._train_on(episodes, step)


def test_a_trainer_killed_while_stopped_is_found_dead_by_its_exit_in_seconds(
        tiny_ckpt, tmp_path, caplog, fault_record):
    controller = TrainerKilledWhileStopped(load_config(None, small_run_overrides(tiny_ckpt, tmp_path)))
    with caplog.at_level(logging.WARNING, logger="rlactors.procs.liveness"), pytest.raises(TrainingError) as raised:
        asyncio.run(asyncio.wait_for(controller.run(), 120))
    stopped_s = time.monotonic() - controller.killed_at  # the run stopped (shutdown included)
    label = f"trainer rank 0 (pid {controller.killed_pid})"
    seen = next(r.created for r in caplog.records if f"{label} exited" in r.getMessage())
    detection_s = seen - controller.killed_at_wall
    assert detection_s < DETECTED_WITHIN_S, detection_s
    message = str(raised.value)
    # Read from the zombie or, once Monarch's host agent has reaped it, from the pidfd (Linux
    # 6.15+); an older kernel may lose that race, and then the message says so.
    exits = [describe_wait_status(signal.SIGKILL)] + ([] if PIDFD_KEEPS_EXIT_STATUS else [describe_wait_status(None)])
    assert any(message.startswith(f"step 2: {label} {verdict}; ") for verdict in exits), message
    assert "likely crashed" not in message and message.endswith("continue with --resume")
    assert stopped_s < DETECTED_WITHIN_S + 10, stopped_s
    fault_record("trainer proc killed while unresponsive", "SIGSTOP of the trainer proc as step 2's update began, "
                 "SIGKILL 2 s later (Monarch's state query to it in flight: Monarch alone took 57.7 s with a 60 s "
                 "query wait)", detection_s, f"step 2's update: the run stopped with `{message.split(';')[0]}`",
                 controller_exit_s=stopped_s)


def test_a_replica_killed_while_stopped_is_found_dead_in_seconds_and_its_requests_complete(
        tiny_ckpt, fault_record):
    from monarch.actor import this_host

    from rlactors.actors.router import GeneratorRouter
    from rlactors.config import GeneratorConfig, ModelConfig
    from rlactors.types import SamplingParams

    config = GeneratorConfig(replicas=2, max_num_seqs=64, max_num_tokens=1024, kv_cache_tokens=8192,
                             max_model_len=256, restart_dead=True)

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        router = procs.spawn("router", GeneratorRouter, config, ModelConfig(path=str(tiny_ckpt)))
        try:
            pid = (await router.stats.call_one())["replicas"][1]["engine"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            # Sent while replica 1 is stopped: some reach it (it is not slow yet) and wait there.
            requests = asyncio.ensure_future(asyncio.gather(*(
                router.generate.call_one([5 + i, 6, 7], SamplingParams(max_tokens=4, seed=i), f"r{i}")
                for i in range(8))))
            await asyncio.sleep(2.0)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            while (stats := await router.stats.call_one())["deaths"] != 1:
                assert time.monotonic() - killed_at < 60, stats
                await asyncio.sleep(0.05)
            detection_s = time.monotonic() - killed_at
            completions = await asyncio.wait_for(requests, 60)
            stats = await router.stats.call_one()
            return detection_s, completions, stats
        finally:
            await router.close.call_one()
            await procs.stop()

    detection_s, completions, stats = asyncio.run(main())
    assert detection_s < DETECTED_WITHIN_S, detection_s
    assert [c.request_id for c in completions] == [f"r{i}" for i in range(8)]
    assert all(len(c.token_ids) == 4 for c in completions)
    fault_record("generator replica proc killed while unresponsive", "SIGSTOP of replica 1's proc with 8 requests "
                 "sent, SIGKILL 2 s later (Monarch's state query to it in flight: Monarch alone took 57.7 s with "
                 "a 60 s query wait)", detection_s,
                 f"nothing: 8/8 requests completed ({stats['retries']} retried on replica 0)")


@pytest.mark.slow
def test_a_cpu_demo_run_completes_on_a_3x_oversubscribed_machine(tiny_ckpt, tmp_path, fault_record):
    # The CPU demo's config (2 trainer procs over gloo, 2 replicas), shortened to 2 steps (a weight
    # sync between them) of 4 prompts x 4 rollouts. Its 5 procs start sharing the cores with each
    # other; once they are placed, 3 spinning processes per core compete with them and the controller
    # through the attach, both steps, the sync and the shutdown. (Spinning during the start-up too
    # only slows the imports, by minutes.) What a false death needs is a proc starved of CPU, whatever
    # the work of a step: each proc's liveness is answered by a thread of its own.
    spinners = 3 * os.cpu_count()
    cli = CliProcess(f'model.path="{tiny_ckpt}"', f'controller.run_dir="{tmp_path}"', "controller.steps=2",
                     "rollout.prompts_per_step=4", "controller.eval_every=0", "controller.checkpoint_every=0")
    try:
        wait_until(lambda: cli.proc.poll() is not None or cli.first_line_after("stdout", 0, "trainer ranks on "),
                   600, 0.1, "the procs placed")
        start = time.monotonic()
        with Spinners(spinners):
            code = cli.wait(900)
    finally:
        if cli.proc.poll() is None:
            cli.proc.kill()
            cli.wait()
    wall_s = time.monotonic() - start
    stderr = cli.text("stderr")
    assert code == 0, stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert "likely crashed" not in stderr and " exited" not in stderr, stderr[-3000:]
    fault_record("busy machine", f"the CPU demo config (2 steps of 4 prompts), once placed, beside {spinners} spinning "
                 f"processes on {os.cpu_count()} cores", None, "nothing: the run completed", wall_s=wall_s)


class StopNeverReturns(Controller):
    """A shutdown whose router close and proc stops never return, as when a proc is inside a
    collective whose peer died."""

    async def _stop(self) -> None:
        await asyncio.Event().wait()


def test_a_shutdown_that_never_returns_kills_the_procs_after_its_wait(tiny_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(meshes_module, "SHUTDOWN_WAIT_S", 2.0)
    controller = StopNeverReturns(load_config(None, small_run_overrides(tiny_ckpt, tmp_path)))

    async def start_then_shut_down():
        await controller.start()
        procs = {p.name: p.pid for p in controller.meshes.watcher.procs}
        replica = (await controller.router.stats.call_one())["replicas"][0]["engine"]["pid"]
        start = time.monotonic()
        await controller.shutdown()
        return procs, replica, time.monotonic() - start

    procs, replica, took = asyncio.run(start_then_shut_down())
    assert set(procs) == {"trainer rank 0", "generator router"} and took < 10, (procs, took)
    # The replica's proc (started by this process's host agent, as the others) goes too.
    wait_until(lambda: not any(running(pid) for pid in [*procs.values(), replica]), 30, 0.1, "every proc gone")
    assert (f"warning: the procs did not stop within 2 s; killed trainer rank 0 (pid {procs['trainer rank 0']}), "
            f"generator router (pid {procs['generator router']}), replica pid {replica}") in capsys.readouterr().err
