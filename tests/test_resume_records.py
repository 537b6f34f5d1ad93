"""Records and checkpoints agree after a crash at any instant of a step's end (no procs: the run
dir is written by the real record and checkpoint-commit code, in the order the controller
writes it, and cut at each point); torn JSONL lines; storage faults as one line; a run dir
without a checkpoint; --resume on the run's own config.toml."""

import errno
import json

import pytest

from rlactors.config import dump_toml, load_config
from rlactors.run.metrics import REWARD_MEAN, MetricsLogger, plot_reward_curve, read_metrics
from rlactors.run.run_dir import ResumeState, RunComplete, RunDir, TrainingError
from rlactors.storage.records import keep_records_through, read_records
from rlactors.train import main
from rlactors.trainer.checkpoint import checkpoint_dir, commit, latest_checkpoint, partial_dir

STEPS, EVERY = 4, 2


def _config(run_dir, *extra):
    return load_config(overrides=['model.path="/not/read"', f"controller.steps={STEPS}",
                                  f"controller.checkpoint_every={EVERY}", f'controller.run_dir="{run_dir}"', *extra])


def _save(run_dir, step, cut=False):
    """A checkpoint of `step` as the trainer writes it (the controller's state, then the commit:
    manifest, COMPLETE, rename); `cut`: a save killed before its commit."""
    root = RunDir(run_dir).checkpoints
    partial = partial_dir(root, step)
    partial.mkdir(parents=True, exist_ok=True)
    for name, text in ResumeState(step, step, samples={"next": step}, rollouter={}).files().items():
        (partial / name).write_text(text)
    if not cut:
        commit(partial, checkpoint_dir(root, step), {"step": step, "policy_version": step})


def _events(first_step):
    """What the run writes at each step's end, in the controller's order: the checkpoint when
    due, the step's samples, its metrics record. (name, step, write(logger, run_dir, cut))."""
    events = []
    for step in range(first_step, STEPS + 1):
        if step % EVERY == 0 or step == STEPS:
            events.append(("save", step, lambda log, run, cut, s=step: _save(run, s, cut)))
        events.append(("samples", step, lambda log, run, cut, s=step: _write_cut(
            log.samples_path, cut, lambda: log.log_samples(s, [{"which": "best"}, {"which": "worst"}]))))
        events.append(("metrics", step, lambda log, run, cut, s=step: _write_cut(
            log.metrics_path, cut, lambda: log.log(s, {REWARD_MEAN: s / 10}))))
    return events


def _write_cut(path, cut, write):
    """`write`, or (cut) the first half of what it appends: a process killed mid-write."""
    before = path.read_bytes() if path.exists() else b""
    write()
    if cut:
        after = path.read_bytes()
        path.write_bytes(after[:len(before) + (len(after) - len(before)) // 2 + 1])  # inside a line


def _resume_and_finish(run_dir):
    """--resume as the controller does it: the checkpoint RunDir.check picks, the records cut back
    to its step, then the remaining steps' writes."""
    try:
        path = RunDir(run_dir).check(_config(run_dir), resume=True)
    except RunComplete:  # killed after the last step's records
        return STEPS
    step = ResumeState.read(path).step if path else 0
    logger = MetricsLogger(run_dir, STEPS, resume_step=step, tensorboard=False)
    for _, _, write in _events(step + 1):
        write(logger, run_dir, False)
    return step


KILLS = [(i, cut) for i in range(len(_events(1))) for cut in (False, True)]


@pytest.mark.parametrize("index,cut", KILLS, ids=[f"{e[0]}{e[1]}{'-cut' if c else ''}"
                                                  for (i, c) in KILLS for e in [_events(1)[i]]])
def test_a_kill_at_any_point_of_a_steps_end_leaves_every_step_recorded_once_after_resume(tmp_path, index, cut,
                                                                                         capsys):
    logger = MetricsLogger(tmp_path, STEPS, tensorboard=False)
    for _, _, write in _events(1)[:index]:
        write(logger, tmp_path, False)
    name, step, write = _events(1)[index]
    if cut:  # killed in the middle of this write
        write(logger, tmp_path, True)
    else:  # killed right after it
        write(logger, tmp_path, False)
    resumed = _resume_and_finish(tmp_path)
    out = capsys.readouterr()
    metrics = [r["step"] for r in read_records(tmp_path / "metrics.jsonl")]
    samples = [r["step"] for r in read_records(tmp_path / "samples.jsonl")]
    assert metrics == list(range(1, STEPS + 1)), (name, step, cut, out)
    assert samples == [s for s in range(1, STEPS + 1) for _ in range(2)], (name, step, cut, out)
    # The newest complete checkpoint is of the last step; no partial dir of a cut save is left.
    assert latest_checkpoint(RunDir(tmp_path).checkpoints) == checkpoint_dir(RunDir(tmp_path).checkpoints, STEPS)
    assert not list(RunDir(tmp_path).checkpoints.glob(".*"))
    if name == "save" and not cut:  # committed, records not written: passed over, said so
        assert f"the checkpoint of step {step} is passed over" in out.out
        assert resumed == step - EVERY
    if cut and name != "save":
        assert "torn line" in out.err


def test_torn_lines_are_dropped_and_said_in_one_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')
    assert [r["step"] for r in read_records(path)] == [1, 2]
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: dropped 1 torn line(s) (line 3): a write cut short"]
    keep_records_through(path, 5)
    assert path.read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left


def test_the_reward_curve_is_drawn_from_a_metrics_file_with_a_torn_line(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {REWARD_MEAN: step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert plot_reward_curve(tmp_path).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_a_record_the_disk_refuses_names_its_file(tmp_path, monkeypatch, code):
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    logger.log(1, {REWARD_MEAN: 0.1})
    _save(tmp_path, 1)
    real_open = type(logger.metrics_path).open

    def refusing_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)

        class Refusing:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, data):
                raise OSError(code, "injected")  # a failed write() names no file

            writelines = write

        return Refusing()

    monkeypatch.setattr(type(logger.metrics_path), "open", refusing_open)
    for write, path in ((lambda: logger.log(2, {REWARD_MEAN: 0.2}), logger.metrics_path),
                        (lambda: logger.log_samples(2, [{"x": 1}]), logger.samples_path)):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.errno == code and raised.value.filename == str(path)
        line = RunDir(tmp_path).storage_error(raised.value)
        assert line == (f"cannot write {path}: injected ({errno.errorcode[code]}); the last complete checkpoint is "
                        f"{checkpoint_dir(tmp_path / 'checkpoints', 1)}; once it can be written, continue with "
                        "--resume")


def test_a_storage_fault_before_any_checkpoint_does_not_offer_a_checkpoint(tmp_path):
    line = RunDir(tmp_path).storage_error(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")),
                                          "saving the checkpoint of step 1 failed")
    assert line == (f"saving the checkpoint of step 1 failed: cannot write {tmp_path / 'x'}: No space left on device "
                    "(ENOSPC); no checkpoint was completed (--resume restarts the run from step 0)")


def test_a_reward_curve_the_disk_refuses_leaves_no_png_and_never_replaces_the_first_error(tmp_path, monkeypatch):
    import matplotlib.figure

    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    logger.log(1, {REWARD_MEAN: 0.1})

    def half_written(fig, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises(OSError) as raised:
        plot_reward_curve(tmp_path)
    assert raised.value.filename == str(tmp_path / ".reward_curve.png.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no PNG, cut or empty
    assert logger.close(failing=True) is None  # a run stopping on another error keeps that one
    with pytest.raises(OSError):
        logger.close()


def test_a_storage_fault_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    from rlactors.run.controller import Controller

    async def start(self):
        self.run_dir.write_config(self.config)

    async def nothing(self):
        return None

    def refused(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Controller, "start", start)
    monkeypatch.setattr(Controller, "shutdown", nothing)
    monkeypatch.setattr(type(tmp_path), "write_text", refused)
    assert main(['model.path="/not/read"', f'controller.run_dir="{tmp_path}"']) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot write {tmp_path / 'config.toml'}: Read-only file system (EROFS); no checkpoint was "
        "completed (--resume restarts the run from step 0)"]


def test_resume_without_a_checkpoint_restarts_from_step_0_and_clears_the_records(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, STEPS, tensorboard=False)
    logger.log(1, {REWARD_MEAN: 0.1})
    logger.log_samples(1, [{"x": 1}])
    _save(tmp_path, 2, cut=True)  # a save that never committed
    with pytest.raises(TrainingError, match="already holds a run"):
        RunDir(tmp_path).check(_config(tmp_path), resume=False)
    capsys.readouterr()
    assert RunDir(tmp_path).check(_config(tmp_path), resume=True) is None
    assert list(RunDir(tmp_path).checkpoints.iterdir()) == []  # the cut save's partial dir is removed
    assert capsys.readouterr().out.splitlines() == [
        f"--resume: no intact checkpoint under {tmp_path / 'checkpoints'} (for a recorded step): the run restarts "
        "from step 0 (model.path) and its records are cleared"]
    MetricsLogger(tmp_path, STEPS, resume_step=0, tensorboard=False)
    assert read_metrics(tmp_path) == [] and (tmp_path / "samples.jsonl").read_text() == ""


def test_resume_takes_the_runs_own_config_with_the_overrides_on_top(tmp_path, capsys):
    ran = _config(tmp_path, "trainer.lr=3e-4", 'env.args={ max_turns = 1, max_names_per_turn = 2 }')
    (tmp_path / "config.toml").write_text(dump_toml(ran))
    _save(tmp_path, STEPS)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, REWARD_MEAN: 0.0}) + "\n"
                                                    for s in range(1, STEPS + 1)))
    # Only the run dir is named: model.path, env and lr come from its config.toml; steps is on top.
    assert main(["--resume", f'controller.run_dir="{tmp_path}"']) == 0
    out = capsys.readouterr().out
    assert f"nothing to train: the run in {tmp_path} is at step {STEPS}" in out
    with pytest.raises(RunComplete):
        RunDir(tmp_path).check(ran, resume=True)
    from rlactors.train import load_resumed_config

    class Args:
        config = None
        overrides = [f'controller.run_dir="{tmp_path}"', "controller.steps=9"]

    config = load_resumed_config(Args, None)
    assert (config.model.path, config.trainer.lr, config.env.args, config.controller.steps) == (
        "/not/read", 3e-4, {"max_turns": 1, "max_names_per_turn": 2}, 9)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_a_checkpoint_the_disk_refuses_stops_the_run_naming_the_file_and_the_last_checkpoint(tmp_path, code):
    """The trainer's save raised a storage fault (every rank raises it: rlactors.trainer.core):
    the controller's line names the save's step, the file and the last complete checkpoint."""
    import asyncio

    from monarch.actor import ActorError

    from rlactors.run.controller import Controller

    _save(tmp_path, 2)
    cut = tmp_path / "checkpoints" / ".step_00000004.partial" / "dcp"

    class Refused:
        async def call(self, *args):
            raise ActorError(OSError(code, "injected", str(cut)))

    class Trainer:
        save_checkpoint = Refused()

    class State:
        def state_dict(self):
            return {}

    controller = Controller(_config(tmp_path))
    controller.trainer, controller.samples, controller.rollouter, controller.step = Trainer(), State(), State(), 4
    with pytest.raises(TrainingError) as raised:
        asyncio.run(controller.save_checkpoint())
    assert str(raised.value) == (
        f"saving the checkpoint of step 4 failed: cannot write {cut}: injected ({errno.errorcode[code]}); the last "
        f"complete checkpoint is {checkpoint_dir(tmp_path / 'checkpoints', 2)}; once it can be written, continue "
        "with --resume")
