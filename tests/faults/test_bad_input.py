"""Bad configs and inputs through the CLI (examples/alphabet_sort/run.py): every config field with
a wrong type or an impossible value, a checkpoint dir that is missing or is not one, that lacks
its tokenizer files, weights or a shard, whose config.json is not JSON or of an unsupported
model_type, or whose tokenizer outgrows the model's vocabulary, a tokenizer without a chat
template, an empty dataset, a bad env name, a new run into a run dir that holds a run, --resume
with nothing to resume, with another env or seed than the run's or with a config.toml that is not
TOML. Each gives one
line `error: <what>: ...` naming the problem and exit code 2, before anything trains; --resume of
a run that has all its steps says so and exits 0."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import typing

import fault_envs
import pytest
from faultkit import run_cli
from rlactors_examples.alphabet_sort.run import DEFAULT_CONFIG, main

from rlactors.config import Config, dump_toml, load_config
from rlactors.evaluate import main as evaluate_main
from rlactors.models.checkpoint import (
    SINGLE_FILE,
    TOKENIZER_FILES,
    load_args,
    load_state_dict,
    save_pretrained,
)
from rlactors.models.tiny import random_state_dict
from rlactors.models.tokenizer import VOCABULARY_FILES, load_tokenizer
from rlactors.run.metrics import REWARD_MEAN
from rlactors.run.run_dir import RunDir
from rlactors.storage.manifest import write_manifest
from rlactors.trainer.checkpoint import COMPLETE_FILE, checkpoint_dir

# Any value is well-typed here; what matters is that load_config rejects it before the run.
BASE = ['model.path="/nonexistent/never-read"', 'controller.run_dir="/nonexistent/never-written"']


def config_fields() -> dict[str, typing.Any]:
    """Every leaf key of Config (`section.field`) and its annotation."""
    fields = {}
    for section, cls in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields[f"{section}.{f.name}"] = hints[f.name]
    return fields


def wrong_type_value(annotation) -> str:
    """A TOML value of another type than `annotation` asks for."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal or annotation is str:
        return "5"
    if annotation is bool:
        return "1"
    if annotation in (int, float):
        return '"many"'
    if origin is tuple:
        return "0.9"
    if origin is dict or dataclasses.is_dataclass(annotation):
        return "5"
    raise AssertionError(f"no wrong-type value for {annotation!r}")


# (overrides, the key the error must name). At least one per field that can hold an impossible
# value of the right type, i.e. every field but the booleans (checked by the test below).
IMPOSSIBLE = [
    (['model.path=""'], "model.path"),
    (['model.dtype="float8"'], "model.dtype"),
    (["trainer.ranks=0"], "trainer.ranks"),
    (["trainer.lr=0"], "trainer.lr"),
    (["trainer.lr=inf"], "trainer.lr"),
    (["trainer.lr=nan"], "trainer.lr"),
    (["trainer.betas=[1.0, 0.9]"], "trainer.betas"),
    (["trainer.weight_decay=-0.1"], "trainer.weight_decay"),
    (["trainer.weight_decay=inf"], "trainer.weight_decay"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps"),
    (["trainer.router_aux_loss_coef=-0.01"], "trainer.router_aux_loss_coef"),
    (["trainer.router_aux_loss_coef=inf"], "trainer.router_aux_loss_coef"),
    (["trainer.max_grad_norm=0"], "trainer.max_grad_norm"),
    (["trainer.logprob_chunk_tokens=0"], "trainer.logprob_chunk_tokens"),
    (["trainer.expert_parallel=3"], "trainer.expert_parallel"),  # does not divide trainer.ranks (2)
    (["model.routing_replay=true", "model.true_on_policy=true"], "model.routing_replay"),
    (['generator.engine="sglang"'], "generator.engine"),
    (['generator.engine="vllm"'], "generator.engine"),  # vllm needs controller.device = "cuda"
    (["generator.replicas=0"], "generator.replicas"),
    (["generator.tp=2"], "generator.tp"),  # tensor parallelism needs vllm
    (["generator.max_num_seqs=0"], "generator.max_num_seqs"),
    (["generator.max_num_tokens=0"], "generator.max_num_tokens"),
    (["generator.kv_cache_tokens=100"], "generator.kv_cache_tokens"),  # < max_model_len
    (["generator.block_size=0"], "generator.block_size"),
    (["generator.max_model_len=1"], "generator.max_model_len"),
    (["generator.gpu_memory_utilization=1.5"], "generator.gpu_memory_utilization"),
    (['generator.update_mode="swap"'], "generator.update_mode"),
    (['generator.weight_sync="nccl"'], "generator.weight_sync"),
    (["rollout.group_size=1"], "rollout.group_size"),  # GRPO needs 2 rollouts per prompt
    (["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
    (["rollout.max_total_tokens=4096"], "rollout.max_total_tokens"),  # > generator.max_model_len
    (["rollout.max_tokens_per_turn=2000"], "rollout.max_tokens_per_turn"),  # > rollout.max_total_tokens
    (["rollout.step_timeout_s=0"], "rollout.step_timeout_s"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.temperature=inf"], "rollout.temperature"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.top_k=-1"], "rollout.top_k"),
    (['rollout.advantage="ppo"'], "rollout.advantage"),
    (["rollout.error_reward=nan"], "rollout.error_reward"),
    (["rollout.error_reward=-inf"], "rollout.error_reward"),
    (["rollout.overlong_buffer_tokens=4096"], "rollout.overlong_buffer_tokens"),  # > max_tokens_per_turn
    (["rollout.overlong_buffer_tokens=-1"], "rollout.overlong_buffer_tokens"),
    (["rollout.overlong_penalty=-1"], "rollout.overlong_penalty"),
    (["rollout.overlong_penalty=inf"], "rollout.overlong_penalty"),
    (["batcher.row_tokens=1"], "batcher.row_tokens"),
    (["batcher.rows_per_microbatch=0"], "batcher.rows_per_microbatch"),
    (['batcher.overlong="wrap"'], "batcher.overlong"),
    (['loss.name="ppo"'], "loss.name"),
    (["loss.clip_low=1.5"], "loss.clip_low"),
    (["loss.clip_high=-0.1"], "loss.clip_high"),
    (["loss.tis_cap=0.5"], "loss.tis_cap"),
    (['loss.tis_level="sequence"'], "loss.tis_level"),  # without loss.tis_cap
    (["loss.is_mask_high=0.5"], "loss.is_mask_high"),
    (["loss.is_mask_low=2"], "loss.is_mask_low"),
    (['loss.is_mask_level="sequence"'], "loss.is_mask_level"),  # without loss.is_mask_high
    (["loss.kl_coef=-1"], "loss.kl_coef"),
    (['loss.kl_estimator="k9"'], "loss.kl_estimator"),
    (['loss.kl_as="advantage"'], "loss.kl_as"),
    (["teacher.coef=0"], "teacher.coef"),
    (["teacher.task_coef=-1"], "teacher.task_coef"),
    (['teacher.path="/teacher"', 'loss.name="sft"'], "teacher.path"),  # distillation with SFT
    (["model.lora.rank=-1"], "model.lora"),
    (["controller.gpu_memory_gib=-1"], "controller.gpu_memory_gib"),
    (["controller.max_errored_steps=-1"], "controller.max_errored_steps"),
    (["controller.restart_trainer=-1"], "controller.restart_trainer"),
    (["gateway.render_threads=0"], "gateway.render_threads"),
    (['controller.device="tpu"'], "controller.device"),
    (['controller.device="cuda"', "trainer.ranks=4096"], "controller.device"),  # more GPUs than visible
    (["controller.steps=0"], "controller.steps"),
    (['controller.mode="lazy"'], "controller.mode"),
    (["controller.max_staleness=-1"], "controller.max_staleness"),
    (["controller.checkpoint_every=-1"], "controller.checkpoint_every"),
    (["controller.keep_checkpoints=1"], "controller.keep_checkpoints"),
    (["controller.eval_every=-1"], "controller.eval_every"),
    (["eval.samples=-1"], "eval.samples"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt"),
    (["eval.temperature=-1"], "eval.temperature"),
    (["eval.temperature=inf"], "eval.temperature"),
    (["eval.pass_reward=inf"], "eval.pass_reward"),
    (['metrics.wandb_project="team/project"'], "metrics.wandb_project"),
    (['metrics.wandb_run="run-1"'], "metrics.wandb_run"),  # a W&B run without a project
    (['controller.run_dir=""'], "controller.run_dir"),
    (["controller.seed=-1"], "controller.seed"),
    (["controller.seed=4294967296"], "controller.seed"),  # sampling seeds would overflow 63 bits
    (["controller.unresponsive_timeout_s=1"], "controller.unresponsive_timeout_s"),  # scheduling noise
    (['gateway.host=""'], "gateway.host"),
    (['gateway.host="127.0.0.1 "'], "gateway.host"),
    (["gateway.port=65536"], "gateway.port"),
    (["gateway.port=-1"], "gateway.port"),
    (["gateway.max_request_bytes=100"], "gateway.max_request_bytes"),
    (["gateway.max_messages=0"], "gateway.max_messages"),
    (["controller.unresponsive_timeout_s=900"], "controller.unresponsive_timeout_s"),  # after Monarch's own
    (['job.scheduler="kubernetes"'], "job.scheduler"),
    (['job.scheduler="process"', 'controller.device="cuda"', 'generator.engine="vllm"'], "job.scheduler"),
    (["job.trainer_hosts=0"], "job.trainer_hosts"),
    (["job.trainer_hosts=2"], "job.trainer_hosts"),  # 'local' is one host
    (["job.generator_hosts=-1"], "job.generator_hosts"),
    (["job.generator_hosts=2"], "job.generator_hosts"),  # 'local' is one host
    (['job.scheduler="process"', "job.generator_hosts=3"], "generator.replicas"),  # 2 replicas over 3 hosts
    (['job.scheduler="process"', "job.trainer_hosts=4"], "trainer.ranks"),  # 2 ranks over 4 hosts
    (["job.gpus_per_host=0"], "job.gpus_per_host"),
    (['job.partition="gpu h200"'], "job.partition"),
    (["job.worker_port=70000"], "job.worker_port"),
    (['job.time_limit="two hours"'], "job.time_limit"),
    (['job.scheduler="slurm"', 'controller.device="cuda"', "trainer.ranks=16"], "job.gpus_per_host"),
    (['job.scheduler="slurm"', 'controller.device="cuda"', "controller.colocate=true"], "controller.colocate"),
    (['env.name="alphabet_sort"'], "env.name"),
    (["env.args={ bogus = 1 }"], "env.args.bogus"),
    (["env.args={ num_samples = 0 }"], "env.args.num_samples"),  # an empty dataset
    (["trainer.lrr=1e-5"], "trainer.lrr"),  # unknown key
    (["optimizer.lr=1e-5"], "optimizer"),  # unknown section
    (["trainer.lr"], "override 'trainer.lr'"),  # not key=value
]


def cli_error(capsys, *argv: str) -> str:
    """The CLI's stderr for `argv`, which must be one `error:` line with exit code 2."""
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


@pytest.mark.parametrize("key", sorted(config_fields()))
def test_every_config_field_with_a_wrong_type_names_the_field(capsys, key):
    value = wrong_type_value(config_fields()[key])
    assert cli_error(capsys, *BASE, f"{key}={value}").startswith(f"error: {key}: expected ")


def test_every_config_field_that_can_be_impossible_has_a_case(fault_record):
    fields = config_fields()
    covered = {key for _, key in IMPOSSIBLE}
    untested = sorted(k for k, tp in fields.items() if tp is not bool and k not in covered and k != "env.args")
    assert not untested, f"no impossible-value case for {untested}"
    fault_record("bad config", f"each of the {len(fields)} config fields given a value of the wrong type; "
                 f"{len(IMPOSSIBLE)} impossible values (NaN/inf, out of range, contradicting another key, "
                 "unknown key or section, malformed override)", None,
                 "nothing starts: one line `error: <key>: ...`, exit code 2")


@pytest.mark.parametrize(("overrides", "key"), IMPOSSIBLE, ids=[" ".join(o) for o, _ in IMPOSSIBLE])
def test_impossible_config_values_name_the_field(capsys, tiny_ckpt, overrides, key):
    # env.args is checked by the env's own Config when the env is built, so it needs a real model.path.
    base = BASE if not overrides[0].startswith("env.args") else [f'model.path="{tiny_ckpt}"', BASE[1]]
    line = cli_error(capsys, *base, *overrides)
    assert line.startswith(f"error: {key}"), line


def test_config_file_missing_or_not_toml(capsys, tmp_path):
    assert cli_error(capsys, "--config", str(tmp_path / "none.toml")) == \
        f"error: config file not found: {tmp_path / 'none.toml'}"
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    assert cli_error(capsys, "--config", str(bad)).startswith(f"error: {bad}: invalid TOML: ")


@pytest.fixture
def no_template_ckpt(tiny_ckpt, tmp_path):
    """tiny_ckpt whose tokenizer has no chat template."""
    ckpt = tmp_path / "no_template"
    shutil.copytree(tiny_ckpt, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    return ckpt


def test_bad_model_dirs_and_envs_are_named_before_any_proc_starts(capsys, tmp_path, tiny_ckpt, no_template_ckpt,
                                                                   fault_record):
    run_dir = f'controller.run_dir="{tmp_path / "run"}"'
    (tmp_path / "empty").mkdir()
    cases = [
        ([f'model.path="{tmp_path / "missing"}"'],
         f"error: model.path: checkpoint directory not found: {tmp_path / 'missing'}"),
        ([f'model.path="{tmp_path / "empty"}"'],
         f"error: model.path: {tmp_path / 'empty'} is not a HF checkpoint directory (no config.json)"),
        ([f'model.path="{no_template_ckpt}"'],  # alphabet_sort is a chat (MessageEnv) env
         f"error: model.path: the tokenizer of '{no_template_ckpt}' has no chat template; "
         "AlphabetSortEnv is a MessageEnv and renders its messages with it"),
        ([f'model.path="{tiny_ckpt}"', 'env.name="fault_envs:FaultyEnv"', "env.args={ empty = true }"],
         "error: env fault_envs:FaultyEnv: the train split is empty"),
        ([f'model.path="{tiny_ckpt}"', 'env.name="no_such_module:Env"'],
         f"error: env.name: no module named 'no_such_module' (looked in the working directory {os.getcwd()} "
         "and on sys.path)"),
        ([f'model.path="{tiny_ckpt}"', 'env.name="fault_envs:NoSuchEnv"'],
         f"error: env.name: module 'fault_envs' ({fault_envs.__file__}) has no 'NoSuchEnv'"),
        ([f'model.path="{tiny_ckpt}"', 'env.name="fault_envs:VOCAB"'],
         "error: env.name: 'fault_envs:VOCAB' is not a TokenEnv subclass"),
        ([f'model.path="{tiny_ckpt}"', f'teacher.path="{tmp_path / "missing"}"'],
         f"error: teacher.path: checkpoint directory not found: {tmp_path / 'missing'}"),
    ]
    for overrides, expected in cases:
        assert cli_error(capsys, run_dir, *overrides) == expected
    assert not (tmp_path / "run").exists()  # nothing was started, nothing written
    fault_record("bad inputs", "model.path or teacher.path missing / not a checkpoint; a tokenizer without a "
                 "chat template under a chat env; an empty train split; env.name naming no module / no class / "
                 "no TokenEnv", None,
                 "nothing starts: one line `error: ...` naming the input, exit code 2")


def test_keys_the_checkpoint_cannot_take_are_named_before_any_proc_starts(capsys, tmp_path, tiny_ckpt, family_ckpt,
                                                                         fault_record):
    run_dir, moe = f'controller.run_dir="{tmp_path / "run"}"', family_ckpt("qwen3_moe")
    cases = [
        ([f'model.path="{tiny_ckpt}"', "model.routing_replay=true"],
         f"error: model.routing_replay: is set, but {tiny_ckpt} (qwen3) has no experts"),
        ([f'model.path="{tiny_ckpt}"', "trainer.expert_parallel=2"],
         f"error: trainer.expert_parallel: is 2, but {tiny_ckpt} (qwen3) has no experts"),
        ([f'model.path="{tiny_ckpt}"', "trainer.router_aux_loss_coef=0.01"],
         f"error: trainer.router_aux_loss_coef: is 0.01, but {tiny_ckpt} (qwen3) has no experts"),
        ([f'model.path="{moe}"', "trainer.ranks=3", "trainer.expert_parallel=3", "generator.replicas=1"],
         "error: trainer.expert_parallel: 3 ranks cannot split the 8 experts evenly"),
    ]
    for overrides, expected in cases:
        assert cli_error(capsys, run_dir, *overrides) == expected
    assert not (tmp_path / "run").exists()
    fault_record("bad config", "model.routing_replay, trainer.expert_parallel or trainer.router_aux_loss_coef for a "
                 "model without experts; expert_parallel that does not divide the experts", None,
                 "nothing starts: one line `error: <key>: ...`, exit code 2")


def _broken_copies(tiny_ckpt, root):
    """Copies of tiny_ckpt, each missing or spoiling one thing a run loads: {name: dir}."""
    dirs = {}
    for name in ("no_tokenizer", "no_weights", "damaged_weights", "missing_shard", "gemma2", "config_not_json",
                 "small_vocab"):
        dirs[name] = root / name
        shutil.copytree(tiny_ckpt, dirs[name])
    for name in TOKENIZER_FILES:
        (dirs["no_tokenizer"] / name).unlink(missing_ok=True)
    (dirs["no_weights"] / SINGLE_FILE).unlink()
    (dirs["damaged_weights"] / SINGLE_FILE).write_bytes(b"\xff" * 64)
    weights = load_state_dict(tiny_ckpt)
    (dirs["missing_shard"] / SINGLE_FILE).unlink()
    save_pretrained(weights, load_args(tiny_ckpt), dirs["missing_shard"], max_shard_bytes=200_000)
    shards = sorted(dirs["missing_shard"].glob("model-*-of-*.safetensors"))
    shards[-1].unlink()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    (dirs["gemma2"] / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    (dirs["config_not_json"] / "config.json").write_text("{model_type: qwen3")
    # A model with fewer embedding rows than the tokenizer has tokens.
    small = dataclasses.replace(load_args(tiny_ckpt), vocab_size=64)
    save_pretrained(random_state_dict(small, seed=0), small, dirs["small_vocab"])
    return dirs, shards[-1].name


def test_incomplete_or_unsupported_checkpoints_are_named_before_any_proc_starts(capsys, tmp_path, tiny_ckpt,
                                                                                fault_record):
    """Without tokenizer files transformers builds a one-token tokenizer and says nothing; an
    unsupported model_type failed in the trainer's procs with a remote traceback."""
    dirs, missing_shard = _broken_copies(tiny_ckpt, tmp_path)
    vocab = ", ".join(VOCABULARY_FILES)
    cases = {
        "no_tokenizer": f"{dirs['no_tokenizer']} has no tokenizer files (none of {vocab}); copy them from the "
                        "model the weights come from",
        "no_weights": f"{dirs['no_weights']} holds no weights (neither model.safetensors nor "
                      "model.safetensors.index.json)",
        "damaged_weights": f"{dirs['damaged_weights']}: cannot read the weights: ",
        "missing_shard": f"{dirs['missing_shard']}: model.safetensors.index.json names weight files that are "
                         f"missing: {missing_shard}",
        "gemma2": f"{dirs['gemma2']}: config.json has model_type 'gemma2'; rlactors supports "
                  "['llama', 'qwen2', 'qwen3', 'qwen3_moe']",
        "config_not_json": f"{dirs['config_not_json'] / 'config.json'} is not JSON: Expecting property name "
                           "enclosed in double quotes: line 1 column 2 (char 1)",
        "small_vocab": f"the tokenizer of {dirs['small_vocab']} has {len(load_tokenizer(tiny_ckpt))} tokens but "
                       "the model's vocab_size is 64: the tokenizer files belong to another model",
    }
    for name, message in cases.items():
        for env in ("fault_envs:FaultyEnv", "rlactors_examples.alphabet_sort.env:AlphabetSortEnv"):  # token, chat
            line = cli_error(capsys, f'model.path="{dirs[name]}"', f'controller.run_dir="{tmp_path / "run"}"',
                             f'env.name="{env}"', "env.args={}")
            assert line == f"error: model.path: {message}" or (name == "damaged_weights" and line.startswith(
                f"error: model.path: {message}")), line
    assert not (tmp_path / "run").exists()  # nothing was started, nothing written
    # The evaluation CLI checks the same before it starts its replicas.
    assert evaluate_main([str(dirs["no_tokenizer"]), "--config", str(DEFAULT_CONFIG)]) == 2
    assert capsys.readouterr().err == f"error: model.path: {cases['no_tokenizer']}\n"
    fault_record("bad inputs", "model.path without tokenizer files, without weights or one of its shards, with "
                 "a damaged weight file, with config.json not JSON or of an unsupported model_type (gemma2), or "
                 "with a tokenizer larger than the model's vocabulary; under a TokenEnv and a MessageEnv", None,
                 "nothing starts: one line `error: model.path: ...` naming what is missing, exit code 2")


def test_bad_data_is_named_before_any_proc_starts(capsys, tmp_path, tiny_ckpt, fault_record):
    """DatasetEnv's data: a missing file or field, an empty file, a row that is not JSON."""
    files = {"missing_field.jsonl": '{"question": "1 + 1?", "answer": "2"}\n{"problem": "2 + 2?", "answer": "4"}\n',
             "empty.jsonl": "", "not_json.jsonl": '{"question": "1 + 1?", "answer": "2"}\n{"question": \n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = {
        "missing_field.jsonl": "row 2: field 'question' is missing (fields: problem, answer)",
        "empty.jsonl": "no records (empty file)",
        "not_json.jsonl": "row 2: not valid JSON (Expecting value at column 14)",
        "absent.jsonl": "file not found",
    }
    for name, message in cases.items():
        line = cli_error(capsys, f'model.path="{tiny_ckpt}"', f'controller.run_dir="{tmp_path / "run"}"',
                         'env.name="rlactors.envs:DatasetEnv"', f'env.args={{ train_path = "{tmp_path / name}" }}')
        assert line == f"error: {tmp_path / name}: {message}"
    assert not (tmp_path / "run").exists()
    fault_record("bad inputs", "DatasetEnv data: a missing file, an empty file, a row that is not JSON, a record "
                 "without the prompt field", None, "nothing starts: one line `error: FILE: row N: field ...`, "
                 "exit code 2")


def test_resume_without_a_checkpoint_restarts_from_step_0_saying_so(capsys, tmp_path, fault_record):
    _run_dir_after(tmp_path, 1)
    shutil.rmtree(tmp_path / "checkpoints")
    config = load_config(DEFAULT_CONFIG, [*RUN, f'controller.run_dir="{tmp_path}"'])
    assert RunDir(tmp_path).check(config, resume=True) is None  # from step 0 (model.path)
    assert capsys.readouterr().out.splitlines() == [
        f"--resume: no intact checkpoint under {tmp_path / 'checkpoints'} (for a recorded step): the run restarts "
        "from step 0 (model.path) and its records are cleared"]
    fault_record("bad inputs", "--resume with no checkpoint in controller.run_dir (a run killed before its first)",
                 None, "the run restarts from step 0, saying so in one line; its records are cleared")


def test_cli_process_prints_one_line_and_exits_2():
    done = run_cli('model.path="/nonexistent/checkpoint"', 'controller.run_dir="/nonexistent/never-written"')
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: model.path: checkpoint directory not found: /nonexistent/checkpoint"]


RUN = ['model.path="/nonexistent/never-read"', 'env.name="fault_envs:FaultyEnv"', "env.args={}", "trainer.ranks=1",
       "generator.replicas=1", "controller.steps=2"]


def _run_dir_after(run_dir, step: int):
    """A run dir as a run of RUN (on the CLI's default config) leaves it after `step` steps: its
    config.toml, metrics.jsonl and a complete checkpoint of the step."""
    config = load_config(DEFAULT_CONFIG, [*RUN, f'controller.run_dir="{run_dir}"'])
    checkpoint = checkpoint_dir(run_dir / "checkpoints", step)
    checkpoint.mkdir(parents=True)
    (checkpoint / "controller_state.json").write_text(json.dumps(
        {"step": step, "policy_version": step, "samples": {}, "rollouter": {}}))
    write_manifest(checkpoint, later=(COMPLETE_FILE,))
    (checkpoint / COMPLETE_FILE).write_text("")
    (run_dir / "config.toml").write_text(dump_toml(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, REWARD_MEAN: 0.0}) + "\n"
                                                   for s in range(1, step + 1)))
    return {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}


def test_a_new_run_never_writes_over_a_run_dir_that_holds_a_run(capsys, tmp_path, fault_record):
    for held in ("metrics.jsonl, checkpoints/step_00000002", "metrics.jsonl", "checkpoints/step_00000002"):
        run_dir = tmp_path / str(len(held))
        _run_dir_after(run_dir, 2)
        if "checkpoints" not in held:
            shutil.rmtree(run_dir / "checkpoints")
        if "metrics" not in held:
            (run_dir / "metrics.jsonl").unlink()
        files = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
        assert cli_error(capsys, *RUN, f'controller.run_dir="{run_dir}"') == (
            f"error: controller.run_dir: {run_dir} already holds a run ({held}); continue it with --resume (from "
            f"step 0 if it has no checkpoint), or give this run another controller.run_dir (or delete {run_dir})")
        assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == files
    fault_record("bad inputs", "a new run (no --resume) into a run dir that holds metrics or a checkpoint", None,
                 "nothing is written: one line `error: controller.run_dir: ... already holds a run ...`, exit code 2")


def test_resume_keeps_the_runs_env_and_seed(capsys, tmp_path, fault_record):
    files = _run_dir_after(tmp_path, 1)
    checkpoint = checkpoint_dir(tmp_path / "checkpoints", 1)
    for override, key, now, was in (('env.name="rlactors_examples.alphabet_sort.env:AlphabetSortEnv"', "env.name",
                                     "'rlactors_examples.alphabet_sort.env:AlphabetSortEnv'", "'fault_envs:FaultyEnv'"),
                                    ("env.args={ num_samples = 8 }", "env.args", "{'num_samples': 8}", "{}"),
                                    ("controller.seed=1", "controller.seed", "1", "0")):
        assert cli_error(capsys, "--resume", *RUN, f'controller.run_dir="{tmp_path}"', override) == (
            f"error: --resume: {key} is {now} here but the run in {tmp_path} has {was} ({tmp_path / 'config.toml'}); "
            "resume it as it was, or start a new run in another controller.run_dir "
            f'(model.path="{checkpoint / "hf"}" starts from this run\'s policy)')
    assert all(path.read_bytes() == data for path, data in files.items())
    fault_record("bad inputs", "--resume with another env.name, env.args or controller.seed than the run's", None,
                 "nothing trains: one line `error: --resume: <key> is ... here but the run ... has ...`, exit code 2")


def test_resume_of_a_run_that_has_all_its_steps_says_so_and_starts_nothing(capsys, tmp_path):
    files = _run_dir_after(tmp_path, 2)
    assert main(["--resume", *RUN, f'controller.run_dir="{tmp_path}"', "trainer.lr=2e-5"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        "resuming with changed settings: trainer.lr 0.0004 -> 2e-05",
        f"nothing to train: the run in {tmp_path} is at step 2 and controller.steps is 2; "
        "raise controller.steps to train further"]
    assert all(path.read_bytes() == data for path, data in files.items())


def test_resume_or_evaluate_with_a_run_config_that_is_not_toml_is_one_line(capsys, tmp_path, tiny_ckpt,
                                                                          fault_record):
    """A config.toml of an older rlactors, which wrote a string's newline as is, is not TOML."""
    _run_dir_after(tmp_path, 1)
    saved = tmp_path / "config.toml"
    saved.write_text(saved.read_text().replace('run_dir = "', 'run_dir = "line\n'))
    line = cli_error(capsys, "--resume", *RUN, f'controller.run_dir="{tmp_path}"')
    assert line.startswith(f"error: {saved}: invalid TOML: Illegal character ")
    checkpoint = checkpoint_dir(tmp_path / "checkpoints", 1)
    shutil.copytree(tiny_ckpt, checkpoint / "hf")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    assert evaluate_main([str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {saved}: invalid TOML: Illegal character "), err
    fault_record("bad inputs", "--resume of a run, or `rlactors.evaluate RUN_DIR`, whose config.toml is not TOML "
                 "(a raw newline in a string)", None,
                 "nothing starts: one line `error: RUN_DIR/config.toml: invalid TOML: ...`, exit code 2")
