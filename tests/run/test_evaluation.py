"""Evaluation without Monarch: the schedule, the Evaluator over a scripted generator, eval/* metrics,
their sinks (metrics.jsonl, TensorBoard, console, reward plot, W&B) and the evaluate command's
checkpoint and config lookup."""

import asyncio
import json
import shutil
import sys
import types

import pytest
from support.eval_envs import VOCAB, SplitEnv
from support.metric_sinks import tensorboard_scalars, wandb_history

from rlactors.config import ConfigError, EnvConfig, EvalConfig, RolloutConfig, load_config
from rlactors.evaluate import load_eval_config, resolve_checkpoint
from rlactors.models import load_tokenizer
from rlactors.rollout import TokenEnv, load_env
from rlactors.rollout.types import Rollout, RolloutStatus
from rlactors.run.evaluation import Evaluator, eval_due, eval_samples, summarize_eval
from rlactors.run.metrics import EVAL_REWARD_MEAN, REWARD_MEAN, MetricsLogger, WandbSink, eval_line, read_metrics
from rlactors.types import Completion


def test_the_schedule_is_step_zero_every_n_steps_and_the_last_step():
    assert [s for s in range(8) if eval_due(s, 3, 7)] == [0, 3, 6, 7]
    assert [s for s in range(8) if eval_due(s, 10, 7)] == [0, 7]
    assert [s for s in range(8) if eval_due(s, 0, 7)] == []
    # A resumed run asks only for the steps it has yet to train: those due before it are not repeated.
    assert [s for s in range(5, 8) if eval_due(s, 3, 7)] == [6, 7]


class ScriptedGenerator:
    """Replies to each request with tokens drawn from its sampling seed, at `self.version`."""

    def __init__(self, version=0, max_tokens=6):
        self.requests, self.version, self.max_tokens = [], version, max_tokens

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        self.requests.append((request_id, session_id, sampling))
        rng = __import__("random").Random(sampling.seed)
        tokens = [rng.randrange(3, VOCAB) for _ in range(min(self.max_tokens, sampling.max_tokens))]
        return Completion(request_id, list(prompt), tokens, [-1.0] * len(tokens), [self.version] * len(tokens),
                          "length")


def _evaluator(generate, **eval_args):
    env = SplitEnv(SplitEnv.Config(num_eval_samples=5))
    config = EvalConfig(**eval_args)
    rollout = RolloutConfig(group_size=4, max_turns=2, max_total_tokens=64, max_tokens_per_turn=6,
                            temperature=0.9, top_p=0.5, top_k=7)
    return Evaluator(env, generate, rollout, config, eval_samples(env, "support.eval_envs:SplitEnv", config))


def test_evaluator_scores_the_first_eval_samples_with_fixed_seeds_and_ids_of_its_own():
    SplitEnv.seen.clear()
    generate = ScriptedGenerator(version=3)
    evaluator = _evaluator(generate, samples=3, samples_per_prompt=2, temperature=0.7)
    metrics = asyncio.run(evaluator.evaluate(step=12, policy_version=3))
    # Samples 0-2 of the eval split, each k=2 times; the train split is never touched.
    assert sorted((s.split, s.sample_id) for s in SplitEnv.seen) == [("eval", i) for i in (0, 0, 1, 1, 2, 2)]
    ids = sorted(request_id for request_id, _, _ in generate.requests)
    assert ids == [f"eval12-{i}/{j}/t0" for i in range(3) for j in range(2)]
    sessions = sorted(session for _, session, _ in generate.requests)
    assert sessions == [f"eval12-{i}/{j}" for i in range(3) for j in range(2)]
    # The eval's sampling, not training's (temperature 0.9, top-p 0.5, top-k 7), and the rollout's
    # seed (sample i, rollout j: i * k + j) times max_turns, plus the turn.
    by_id = {request_id: sampling for request_id, _, sampling in generate.requests}
    for i in range(3):
        for j in range(2):
            sampling = by_id[f"eval12-{i}/{j}/t0"]
            assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 1.0, 0)
            assert sampling.seed == (i * 2 + j) * 2 and sampling.max_tokens == 6
    # The same samples and seeds at another step: evals at different steps are comparable.
    again = ScriptedGenerator(version=5)
    later = asyncio.run(_evaluator(again, samples=3, samples_per_prompt=2, temperature=0.7).evaluate(40, 5))
    assert sorted(s.seed for _, _, s in again.requests) == sorted(s.seed for _, _, s in generate.requests)
    assert later[EVAL_REWARD_MEAN] == metrics[EVAL_REWARD_MEAN]

    rewards = [[sum(t < VOCAB // 2 for t in s.token_ids) / len(s.token_ids) for s in SplitEnv.seen
                if s.request_id.startswith(f"eval12-{i}/")] for i in range(3)]
    flat = [r for group in rewards for r in group]
    assert metrics[EVAL_REWARD_MEAN] == pytest.approx(sum(flat) / 6)
    assert metrics["eval/best@2"] == pytest.approx(sum(max(g) for g in rewards) / 3)
    assert metrics["eval/pass@1"] == sum(r >= 1.0 for r in flat) / 6
    assert (metrics["eval/samples"], metrics["eval/rollouts"], metrics["eval/status/truncated_length"]) == (3, 6, 6)
    assert (metrics["eval/generated_tokens"], metrics["eval/generated_tokens_mean"]) == (36, 6)
    assert (metrics["eval/policy_version"], metrics["eval/policy_version_max"]) == (3, 3)
    assert metrics["eval/time_s"] > 0


def test_greedy_by_default_over_the_whole_eval_split_and_the_newest_version_used():
    generate = ScriptedGenerator()

    async def generate_during_an_update(prompt, sampling, request_id, session_id=None):
        completion = await generate(prompt, sampling, request_id, session_id)
        generate.version = 1  # the weights of version 1 arrive during the eval (async mode)
        return completion

    metrics = asyncio.run(_evaluator(generate_during_an_update).evaluate(0, policy_version=0))
    assert {s.temperature for _, _, s in generate.requests} == {0.0}
    assert metrics["eval/samples"] == metrics["eval/rollouts"] == 5
    assert "eval/pass@1" in metrics and not any(k.startswith(("eval/pass@5", "eval/best@")) for k in metrics)
    assert (metrics["eval/policy_version"], metrics["eval/policy_version_max"]) == (0, 1)


def _rollout(reward, status=RolloutStatus.COMPLETED, components=None):
    return Rollout(group_id="x", index=0, session_id="x/0", seed=0, sample=None, reward=reward, status=status,
                   reward_components={"correct": reward} if components is None else components)


def test_pass_at_k_best_at_k_statuses_and_components():
    groups = [[_rollout(1.1), _rollout(0.0)],  # passes (reward >= 1.0) once in 2
              [_rollout(0.5), _rollout(0.9)],  # never passes
              [_rollout(0.0, RolloutStatus.ERROR_ENV, {}), _rollout(1.0)]]
    metrics = summarize_eval(groups, pass_reward=1.0)
    assert metrics["eval/pass@1"] == pytest.approx(2 / 6)
    assert metrics["eval/pass@2"] == pytest.approx(2 / 3)
    assert metrics["eval/best@2"] == pytest.approx((1.1 + 0.9 + 1.0) / 3)
    assert metrics[EVAL_REWARD_MEAN] == pytest.approx(3.5 / 6)
    assert metrics["eval/reward/correct_mean"] == pytest.approx(3.5 / 5)  # the errored rollout has no component
    assert (metrics["eval/status/completed"], metrics["eval/status/error_env"]) == (5, 1)
    assert summarize_eval(groups, pass_reward=0.9)["eval/pass@2"] == 1.0


class NoSplits(TokenEnv):
    pass


def test_an_env_without_an_eval_split_or_too_few_samples_is_refused_in_one_line(tiny_ckpt, tmp_path):
    with pytest.raises(ConfigError) as error:
        eval_samples(NoSplits(), "my_envs:NoSplits", EvalConfig())
    assert str(error.value) == ("env my_envs:NoSplits has no eval split: dataset('eval') raised "
                                "NotImplementedError: NoSplits does not define dataset()")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    train_only = EnvConfig(name="rlactors.envs:DatasetEnv", args={"train_path": str(tmp_path / "train.jsonl")})
    dataset_env = load_env(train_only, load_tokenizer(tiny_ckpt))
    with pytest.raises(ConfigError) as error:
        eval_samples(dataset_env, "rlactors.envs:DatasetEnv", EvalConfig())
    assert str(error.value) == ("env rlactors.envs:DatasetEnv has no eval split: dataset('eval') raised ConfigError: "
                                "env.args.eval_path: no eval split: set eval_path or eval_fraction")
    with pytest.raises(ConfigError, match=r"^env e:E: the eval split is empty$"):
        eval_samples(SplitEnv(SplitEnv.Config(num_eval_samples=0)), "e:E", EvalConfig())
    with pytest.raises(ConfigError, match=r"^eval\.samples: 9 asked for, but the eval split of env e:E has 8 samples"):
        eval_samples(SplitEnv(), "e:E", EvalConfig(samples=9))
    assert len(eval_samples(SplitEnv(), "e:E", EvalConfig(samples=0))) == 8


@pytest.mark.parametrize("override, message", [
    ("controller.eval_every=-1", r"^controller\.eval_every: must be >= 0"),
    ("eval.samples=-1", r"^eval\.samples: must be >= 0"),
    ("eval.samples_per_prompt=0", r"^eval\.samples_per_prompt: must be >= 1"),
    ("eval.temperature=-0.5", r"^eval\.temperature: must be >= 0"),
    ("eval.pass_reward=inf", r"^eval\.pass_reward: must be finite"),
    ("eval.greedy=true", r"^eval\.greedy: unknown key"),
    ('metrics.wandb_run="r1"', r"^metrics\.wandb_run: names a W&B run, but metrics\.wandb_project is not set"),
    ('metrics.wandb_project="a:b"', r"^metrics\.wandb_project: W&B project names have at most 128 characters"),
])
def test_eval_and_metrics_settings_are_checked_by_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


EVAL_METRICS = {"eval/reward_mean": 0.25, "eval/pass@1": 0.125, "eval/pass@4": 0.5, "eval/best@4": 0.75,
                "eval/samples": 8.0, "eval/rollouts": 32.0, "eval/status/completed": 30.0,
                "eval/status/error_env": 2.0, "eval/generated_tokens_mean": 17.4, "eval/policy_version": 3.0,
                "eval/policy_version_max": 4.0, "eval/time_s": 2.25}


def test_eval_records_reach_jsonl_tensorboard_console_and_the_plot(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=4)
    logger.log_eval(0, {**EVAL_METRICS, EVAL_REWARD_MEAN: 0.1})
    logger.log(1, {REWARD_MEAN: 0.2})
    logger.log(2, {REWARD_MEAN: 0.3})
    logger.log_eval(1, EVAL_METRICS)  # async mode: an eval's record comes after later steps'
    png = logger.close()
    records = read_metrics(tmp_path)
    assert [(r["step"], EVAL_REWARD_MEAN in r) for r in records] == [(0, True), (1, False), (2, False), (1, True)]
    assert {k: v for k, v in records[3].items() if k not in ("step", "time")} == EVAL_METRICS
    scalars = tensorboard_scalars(tmp_path)
    assert scalars[EVAL_REWARD_MEAN] == [(0, pytest.approx(0.1)), (1, pytest.approx(0.25))]
    assert scalars["eval/pass@4"] == [(0, 0.5), (1, 0.5)] and scalars[REWARD_MEAN] == [(1, pytest.approx(0.2)),
                                                                             (2, pytest.approx(0.3))]
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("eval of step 1: reward 0.250  best@4 0.750  pass@1 0.125  pass@4 0.500  errors 2/32  "
                    "8 held-out samples x 4, 17 tokens each, policy versions 3 to 4, 2.2s")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_a_run_with_only_an_eval_draws_its_plot_and_a_resume_drops_later_evals(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    logger.log_eval(0, EVAL_METRICS)
    assert logger.close() is not None
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    logger.log(1, {REWARD_MEAN: 0.2})
    logger.log(2, {REWARD_MEAN: 0.3})
    logger.log_eval(2, EVAL_METRICS)
    resumed = MetricsLogger(tmp_path, total_steps=4, resume_step=1, tensorboard=False)
    assert [(r["step"], EVAL_REWARD_MEAN in r) for r in read_metrics(tmp_path)] == [(0, True), (1, False)]
    resumed.close()
    assert eval_line(0, {EVAL_REWARD_MEAN: 0.5, "eval/samples": 2.0, "eval/rollouts": 2.0}) == (
        "eval of step 0: reward 0.500  2 held-out samples, 0 tokens each, policy version 0, 0.0s")
    # A newest version below the first (the evaluate command once counted the replicas' own 0) is no range.
    assert eval_line(4, {EVAL_REWARD_MEAN: 0.5, "eval/samples": 2.0, "eval/rollouts": 2.0, "eval/policy_version": 4.0,
                         "eval/policy_version_max": 0.0}).endswith("policy version 4, 0.0s")


class FakeWandbRun:
    def __init__(self, **init):
        self.init, self.id, self.logged, self.metrics, self.finished = init, init["id"] or "new-id", [], [], False

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def log(self, row):
        self.logged.append(row)

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []
    module = types.SimpleNamespace(init=lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_the_wandb_sink_gets_what_tensorboard_gets_against_the_run_step(tmp_path, fake_wandb):
    logger = MetricsLogger(tmp_path, total_steps=3, wandb=WandbSink(tmp_path, "proj", "", {"a": 1}, resume=False))
    logger.log(1, {REWARD_MEAN: 0.5, "nan/metric": float("nan")})
    logger.log_eval(0, {EVAL_REWARD_MEAN: 0.25})
    logger.close()
    (run,) = fake_wandb
    assert run.init == {"project": "proj", "name": tmp_path.name, "dir": str(tmp_path), "config": {"a": 1},
                        "id": None, "resume": None}
    assert run.metrics == [("step", None), ("*", "step")] and run.finished
    assert run.logged == [{"step": 1, REWARD_MEAN: 0.5}, {"step": 0, EVAL_REWARD_MEAN: 0.25}]
    scalars = tensorboard_scalars(tmp_path)
    assert {k: v for k, v in scalars.items()} == {REWARD_MEAN: [(1, 0.5)], EVAL_REWARD_MEAN: [(0, 0.25)]}
    # A resumed run logs into the W&B run it started; a new run in another dir starts its own.
    WandbSink(tmp_path, "proj", "named", {}, resume=True)
    assert (fake_wandb[1].init["id"], fake_wandb[1].init["resume"], fake_wandb[1].init["name"]) == (
        "new-id", "allow", "named")


def test_a_missing_wandb_package_is_named_before_the_run_starts(tiny_ckpt, tmp_path, monkeypatch):
    from rlactors.run.controller import Controller

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    config = load_config(None, [f'controller.run_dir="{tmp_path}"', 'metrics.wandb_project="p"',
                                f'model.path="{tiny_ckpt}"'])
    with pytest.raises(ConfigError, match=r'^metrics\.wandb_project: logging to W&B needs the wandb package: '
                                          r'pip install -e "\.\[wandb\]"$'):
        asyncio.run(Controller(config).run())


def test_an_offline_wandb_run_records_the_metrics_jsonl_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False,
                           wandb=WandbSink(tmp_path, "rlactors-test", "", {"controller": {"steps": 2}}, resume=False))
    logger.log_eval(0, {EVAL_REWARD_MEAN: 0.125, "eval/pass@1": 0.0})
    logger.log(1, {REWARD_MEAN: 0.5, "loss/loss": -0.25})
    logger.log(2, {REWARD_MEAN: 0.75, "loss/loss": -0.5})
    logger.log_eval(2, {EVAL_REWARD_MEAN: 0.375, "eval/pass@1": 0.5})
    logger.close()
    expected = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path)]
    assert wandb_history(tmp_path) == expected
    assert (tmp_path / "wandb_run_id").read_text() in str(next((tmp_path / "wandb").glob("offline-run-*")))


def test_the_evaluate_command_finds_the_hf_dir_step_and_run_config_of_any_checkpoint(tiny_ckpt, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "config.toml").parent.mkdir()
    (run_dir / "config.toml").write_text('[controller]\nsteps = 3\n[env]\nname = "support.eval_envs:SplitEnv"\n')
    for step, complete in ((2, True), (3, True), (4, False)):  # step 4's save did not finish
        step_dir = run_dir / "checkpoints" / f"step_{step:08d}"
        shutil.copytree(tiny_ckpt, step_dir / "hf")
        (step_dir / "trainer_state.json").write_text(json.dumps({"step": step, "policy_version": step - 1}))
        if complete:
            (step_dir / "COMPLETE").write_text("")
    newest = run_dir / "checkpoints" / "step_00000003"
    for given in (run_dir, newest, newest / "hf"):
        found = resolve_checkpoint(given)
        assert (found.hf_dir, found.run_config, found.step, found.policy_version) == (
            newest / "hf", run_dir / "config.toml", 3, 2), given
    bare = resolve_checkpoint(tiny_ckpt)
    assert (bare.hf_dir, bare.run_config, bare.step, bare.policy_version) == (tiny_ckpt, None, 0, 0)

    config = load_eval_config(resolve_checkpoint(run_dir), None, ["eval.samples=2"])
    assert (config.model.path, config.env.name, config.eval.samples) == (
        str(newest / "hf"), "support.eval_envs:SplitEnv", 2)
    with pytest.raises(ConfigError, match=r"^--config: .* is not in a run dir \(no config\.toml to read the env and "
                                          r"generator settings from\); name a run config with --config$"):
        load_eval_config(bare, None, [])
    assert load_eval_config(bare, run_dir / "config.toml", []).model.path == str(tiny_ckpt)

    shutil.rmtree(newest / "hf")
    (tmp_path / "unsaved" / "checkpoints").mkdir(parents=True)
    for given, message in ((tmp_path / "nowhere", "no such directory"),
                           (tmp_path / "unsaved", "a run dir without a complete checkpoint under"),
                           (newest, "neither an HF checkpoint dir")):
        with pytest.raises(ValueError, match=message):
            resolve_checkpoint(given)
