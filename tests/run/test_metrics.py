import json

import pytest

from rlactors.rollout.types import Rollout, RolloutGroup, RolloutStatus
from rlactors.run.metrics import (
    EVAL_REWARD_MEAN,
    REWARD_MAX,
    REWARD_MEAN,
    REWARD_MIN,
    REWARD_P25,
    REWARD_P75,
    EnvErrorLog,
    MetricsLogger,
    every_rollout_failed,
    failed_steps_line,
    read_metrics,
    reward_curve_figure,
    reward_trend,
    untrained_reason,
)


def _rewards(low, high):
    return {REWARD_MEAN: (low + high) / 2, REWARD_MIN: low, REWARD_MAX: high}


def test_logger_writes_jsonl_tensorboard_png_and_console(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {**_rewards(step * 0.1, step * 0.3), "loss/loss": -0.5, "nan/metric": float("nan")})
    logger.log_samples(1, [{"reward": 1.0, "text": "x"}])
    png = logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[2][REWARD_MEAN] == (0.3 + 0.9) / 2
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("step    3/3 [####################]") and "reward 0.600" in lines[-1]
    assert json.loads((tmp_path / "samples.jsonl").read_text())["step"] == 1


def test_resume_drops_records_after_the_resumed_step(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {REWARD_MEAN: float(step)})
    logger.log_samples(3, [{"reward": 0.0}])
    resumed = MetricsLogger(tmp_path, total_steps=4, resume_step=2, tensorboard=False)
    resumed.log(3, {REWARD_MEAN: 30.0})
    assert [(r["step"], r[REWARD_MEAN]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_a_run_without_steps_draws_no_curve(tmp_path):
    assert MetricsLogger(tmp_path, total_steps=3, tensorboard=False).close() is None


def test_console_line_counts_env_errors_and_ends_with_the_note(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    metrics = {REWARD_MEAN: 0.0, "rollout/rollouts": 8.0, "rollout/status/error_env": 2.0,
               "rollout/status/error_timeout": 1.0, "rollout/status/error_parse": 1.0,
               "rollout/status/error_generator": 3.0}
    line = logger.console_line(1, metrics, note="trained nothing: equal rewards in each of its 2 groups")
    assert "reward 0.000  env errors 4/8  " in line
    assert line.endswith("trained nothing: equal rewards in each of its 2 groups  eta " + line.rsplit("eta ", 1)[1])
    assert "env errors" not in logger.console_line(1, {REWARD_MEAN: 0.0, "rollout/rollouts": 8.0})


def _failed(index, error, traceback=None, status=RolloutStatus.ERROR_ENV):
    return Rollout(group_id="g0", index=index, session_id=f"g0/{index}", seed=0, sample={"id": index},
                   status=status, error=error, error_traceback=traceback)


def _traceback(line, message):
    return ("Traceback (most recent call last):\n"
            f'  File "/envs/my_env.py", line {line}, in step\n    raise RuntimeError(...)\n{message}')


def test_env_errors_go_to_the_log_and_the_first_of_each_kind_to_the_console(tmp_path, capsys):
    log = EnvErrorLog(tmp_path, console_kinds=2)
    rollouts = [
        _failed(0, "env step raised RuntimeError: bad g0/0", _traceback(7, "RuntimeError: bad g0/0")),
        _failed(1, "env step raised RuntimeError: bad g0/1", _traceback(7, "RuntimeError: bad g0/1")),  # same kind
        Rollout(group_id="g0", index=2, session_id="g0/2", seed=0, sample={"id": 2}),  # completed
        _failed(3, "env step ran past step_timeout_s=1.0", status=RolloutStatus.ERROR_TIMEOUT),
        _failed(4, "env step raised RuntimeError: bad g0/4", _traceback(9, "RuntimeError: bad g0/4")),  # 3rd kind
        _failed(5, "replica died", status=RolloutStatus.ERROR_GENERATOR),  # not the env's
    ]
    assert log.record(1, rollouts) == 4
    assert log.record(2, rollouts[:1]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("env error ")] == [
        "env error in step 1, rollout g0/0 (error_env): env step raised RuntimeError: bad g0/0",
        "env error in step 1, rollout g0/3 (error_timeout): env step ran past step_timeout_s=1.0"]
    assert out[1:5] == _traceback(7, "RuntimeError: bad g0/0").splitlines()
    assert out[-1] == f"env errors of more kinds in step 1: see {tmp_path / 'env_errors.log'}"
    text = (tmp_path / "env_errors.log").read_text()
    assert [line for line in text.splitlines() if line.startswith("env error")] == [
        "env error in step 1, rollout g0/0 (error_env): env step raised RuntimeError: bad g0/0",
        "env error in step 1, rollout g0/1 (error_env): env step raised RuntimeError: bad g0/1",
        "env error in step 1, rollout g0/3 (error_timeout): env step ran past step_timeout_s=1.0",
        "env error in step 1, rollout g0/4 (error_env): env step raised RuntimeError: bad g0/4",
        "env error in step 2, rollout g0/0 (error_env): env step raised RuntimeError: bad g0/0"]
    assert text.count("sample: {'id': 0}\n" + _traceback(7, "RuntimeError: bad g0/0")) == 2
    # A resume appends; a new run starts the file again.
    EnvErrorLog(tmp_path, resume_step=2).record(3, rollouts[:1])
    assert (tmp_path / "env_errors.log").read_text().startswith(text + "--- resumed after step 2 ---\n")
    EnvErrorLog(tmp_path)
    assert (tmp_path / "env_errors.log").read_text() == ""


def test_reward_curve_bands_the_middle_half_of_the_rollouts_and_keeps_its_legend_off_the_data(tmp_path):
    records = [{"step": s, REWARD_MEAN: 0.1 * s, REWARD_MIN: 0.0, REWARD_MAX: 1.0, REWARD_P25: 0.1 * s - 0.05,
                REWARD_P75: 0.1 * s + 0.05} for s in range(1, 9)] + [{"step": 8, EVAL_REWARD_MEAN: 0.7}]
    fig = reward_curve_figure(records, "reward")
    ax = fig.axes[0]
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert (band.min(), band.max()) == pytest.approx((0.05, 0.85))  # the quartiles, not min-max's 0..1
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # right of the axes
    assert ax.get_legend().get_texts()[0].get_text().startswith("middle half of rollouts")
    # Older runs' records have no quartiles: no band, the rest is drawn.
    old = reward_curve_figure([{k: v for k, v in r.items() if k not in (REWARD_P25, REWARD_P75)} for r in records],
                              "reward")
    assert not old.axes[0].collections and len(old.axes[0].lines) == 3


def test_rollout_reward_quartiles_interpolate_between_rewards():
    from rlactors.rollout.rollouter import summarize
    from rlactors.rollout.types import RolloutGroup

    def group(rewards):
        rollouts = [Rollout(group_id="g0", index=i, session_id=f"g0/{i}", seed=i, sample={}, reward=r)
                    for i, r in enumerate(rewards)]
        return RolloutGroup(group_id="g0", sample={}, rollouts=rollouts, zero_variance=False, dropped=False,
                            episodes=[])

    metrics = summarize([group([0.0, 0.0, 1.0, 1.0, 0.5])])
    assert (metrics[REWARD_P25], metrics[REWARD_P75]) == (0.0, 1.0)
    metrics = summarize([group([0.0, 0.2, 0.4]), group([0.6, 0.8])])
    assert (metrics[REWARD_P25], metrics[REWARD_P75]) == pytest.approx((0.2, 0.6))
    assert summarize([group([0.3])])[REWARD_P25] == 0.3


def test_reward_trend_means_the_first_and_last_steps_of_the_run():
    steps = [{"step": s, REWARD_MEAN: s / 100} for s in range(1, 81)]
    # 80 steps: means over steps 1-10 (0.055) and 71-80 (0.755), not the single steps 1 and 80.
    assert reward_trend(steps) == "reward 0.055 over steps 1-10 -> 0.755 over steps 71-80"
    # Short runs: a quarter of the run each, at least one step; a resumed run's steps keep their numbers.
    assert reward_trend(steps[:8]) == "reward 0.015 over steps 1-2 -> 0.075 over steps 7-8"
    assert reward_trend(steps[:3]) == "reward 0.010 over step 1 -> 0.030 over step 3"
    assert reward_trend(steps[4:5]) == "reward 0.050 over step 5"


def test_a_step_whose_every_rollout_failed_says_so_naming_the_most_frequent_error(tmp_path, capsys):
    def group(*rollouts):
        return RolloutGroup("g0", {}, list(rollouts), zero_variance=True, dropped=True, episodes=[])

    harness = "env run raised BadRequestError: Error code: 400 -\n  tools[0]: bad"
    failed = [group(_failed(0, harness), _failed(1, harness)),
              group(_failed(2, "replica died", status=RolloutStatus.ERROR_GENERATOR), _failed(3, harness))]
    error = "error_env: env run raised BadRequestError: Error code: 400 - tools[0]: bad (3 of 4 rollouts)"
    assert every_rollout_failed(failed) == error
    assert untrained_reason(failed, [], 0, 1) == f"every rollout ended in an error, e.g. {error}"
    assert every_rollout_failed(failed + [group(Rollout(group_id="g1", index=0, session_id="g1/0", seed=0,
                                                        sample={}))]) is None
    assert every_rollout_failed([]) is None
    assert failed_steps_line(4, 6, error, 3) == (
        "steps 4-6: every rollout ended in an error, so nothing was trained (3 such steps in a row, "
        f"controller.max_errored_steps=3); the last step's: {error}")
    assert failed_steps_line(1, 1, error, 1).startswith("step 1: every rollout ended in an error")
    # Its step line says why it trained nothing, without the hint for steps of equal rewards.
    MetricsLogger(tmp_path, 3, tensorboard=False).log_step(1, _rewards(0.0, 0.0), failed,
                                                            untrained_reason(failed, [], 0, 1))
    out = capsys.readouterr().out
    assert f"  trained nothing: every rollout ended in an error, e.g. {error}  eta " in out
    assert "GRPO has nothing to learn" not in out
