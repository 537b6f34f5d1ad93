import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from rlactors import config as config_module
from rlactors.config import (
    Config,
    ConfigError,
    GeneratorConfig,
    LossConfig,
    ModelConfig,
    build_dataclass,
    dump_toml,
    gpu_layout,
)
from rlactors.procs.placement import cuda_visible_devices, expandable_segments

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def load_config(path=None, overrides=(), available_gpus=None):
    """rlactors.config.load_config with a model.path (it has no default) before the overrides."""
    return config_module.load_config(path, ['model.path="ckpt"', *overrides], available_gpus)


def test_model_path_has_no_default():
    for overrides in ([], ["model.dtype=bfloat16"]):
        with pytest.raises(ConfigError, match=r"^model\.path: missing; it has no default \(set it in the config "
                                              r"file, or as model\.path=\.\.\.\)$"):
            config_module.load_config(None, overrides)
    with pytest.raises(ConfigError, match=r"^model\.path: must name a checkpoint directory"):
        config_module.load_config(None, ['model.path=""'])
    with pytest.raises(TypeError, match="path"):
        ModelConfig()


def test_a_section_checks_its_values_when_it_is_made():
    """Whoever holds a section holds a valid one: the Batcher, trainer and engines check nothing again."""
    with pytest.raises(ConfigError, match=r"^generator\.kv_cache_tokens: must hold at least one full sequence"):
        GeneratorConfig(kv_cache_tokens=100, max_model_len=512)
    with pytest.raises(ConfigError, match=r"^loss\.clip_low: must be in \[0, 1\], got 1.5"):
        LossConfig(clip_low=1.5)
    assert ModelConfig(path="ckpt").path == "ckpt"


def test_loss_algorithm_keys_load_and_are_checked_with_their_names():
    config = load_config(overrides=["loss.name=gspo", "loss.tis_cap=2.0", "loss.tis_level=sequence",
                                    "loss.is_mask_low=0.5", "loss.is_mask_high=5", "loss.is_mask_level=token",
                                    "loss.kl_coef=0.01", "loss.kl_estimator=k1", "loss.kl_as=reward"])
    loss = config.loss
    assert (loss.name, loss.tis_cap, loss.tis_level, loss.is_mask_low, loss.is_mask_high) == \
        ("gspo", 2.0, "sequence", 0.5, 5.0)
    assert (loss.kl_coef, loss.kl_estimator, loss.kl_as) == (0.01, "k1", "reward") and loss.corrects_mismatch
    assert load_config(overrides=["loss.name=cispo", "loss.clip_low=1"]).loss.clip_low == 1.0
    teacher = load_config(overrides=["teacher.path=big", "teacher.coef=0.5", "teacher.task_coef=0"]).teacher
    assert (teacher.path, teacher.coef, teacher.task_coef) == ("big", 0.5, 0.0)
    for overrides, error in (
        (["loss.name=ppo"], r"^loss\.name: expected one of 'grpo', 'dapo', 'dr_grpo', 'gspo', 'cispo', 'sft'"),
        (["loss.tis_level=sequence"], r"^loss\.tis_level: is 'sequence', but loss\.tis_cap is 0 \(off\)$"),
        (["loss.tis_level=batch"], r"^loss\.tis_level: expected one of 'token', 'sequence', got 'batch'$"),
        (["loss.is_mask_high=0.5"], r"^loss\.is_mask_high: must be 0 \(off\) or >= 1, got 0.5$"),
        (["loss.is_mask_low=0.5"], r"^loss\.is_mask_low: must be in \[0, 1\], and 0 while loss\.is_mask_high is 0"),
        (["loss.is_mask_high=2", "loss.is_mask_low=1.5"], r"^loss\.is_mask_low: must be in \[0, 1\]"),
        (["loss.is_mask_level=sequence"], r"^loss\.is_mask_level: is 'sequence', but loss\.is_mask_high is 0"),
        (["loss.kl_coef=-0.1"], r"^loss\.kl_coef: must be >= 0 and finite, got -0.1$"),
        (["loss.kl_estimator=k2"], r"^loss\.kl_estimator: expected one of 'k1', 'k3', got 'k2'$"),
        (["loss.kl_as=advantage"], r"^loss\.kl_as: expected one of 'loss', 'reward', got 'advantage'$"),
        (["loss.name=sft", "loss.kl_coef=0.1"], r"^loss\.kl_coef: is for policy losses, not 'sft'$"),
        (["loss.name=sft", "loss.is_mask_high=2"], r"^loss\.is_mask_high: is for policy losses, not 'sft'$"),
        (["loss.clip_high=inf"], r"^loss\.clip_high: must be >= 0 and finite, got inf$"),
        (["loss.kl_cof=0.1"], r"^loss\.kl_cof: unknown key"),
        (["teacher.coef=0"], r"^teacher\.coef: must be > 0 and finite, got 0.0$"),
        (["teacher.task_coef=-1"], r"^teacher\.task_coef: must be >= 0 and finite, got -1.0$"),
        (["teacher.path=t", "loss.name=sft"], r"^teacher\.path: distills into a policy loss, not 'sft'$"),
    ):
        with pytest.raises(ConfigError, match=error):
            load_config(overrides=overrides)


def test_defaults_validate():
    config = load_config()
    assert config.generator.engine == "native" and config.controller.device == "cpu"


def test_overrides_change_values_and_parse_toml_types():
    config = load_config(overrides=["trainer.lr=3e-4", "generator.replicas=3", "loss.name=dapo",
                                    "controller.mode=async", "env.args.seed=7", "trainer.betas=[0.8, 0.9]"])
    assert config.trainer.lr == 3e-4
    assert config.generator.replicas == 3
    assert config.loss.name == "dapo"  # a bare word is taken as a string
    assert config.controller.mode == "async"
    assert config.env.args == {"seed": 7}
    assert config.trainer.betas == (0.8, 0.9)


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(overrides=["trainer.lr=1"]).trainer.lr == 1.0
    with pytest.raises(ConfigError, match=r"^trainer\.ranks: expected an integer"):
        load_config(overrides=["trainer.ranks=1.5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", r"^trainer\.lrr: unknown key"),
        ("nosuch.key=1", r"^nosuch: unknown key"),
        ("trainer.lr='fast'", r"^trainer\.lr: expected a number, got 'fast'"),
        ("trainer.mixed_precision=1", r"^trainer\.mixed_precision: expected a boolean"),
        ("generator.engine=sglang", r"^generator\.engine: expected one of 'native', 'vllm'"),
        ("trainer.ranks=0", r"^trainer\.ranks: must be >= 1"),
        ("trainer.lr=-1", r"^trainer\.lr: must be > 0"),
        ("trainer.router_aux_loss_coef=-0.1", r"^trainer\.router_aux_loss_coef: must be >= 0 and finite, got -0.1$"),
        ("trainer.betas=[0.9]", r"^trainer\.betas: expected a list of 2 values"),
        ("rollout.top_p=0", r"^rollout\.top_p: must be in \(0, 1\]"),
        ("rollout.group_size=1", r"^rollout\.group_size: GRPO advantages need at least 2"),
        ("generator.tp=2", r"^generator\.tp: tensor parallelism needs engine = 'vllm'"),
        ("generator.engine=vllm", r"^generator\.engine: 'vllm' needs controller\.device = 'cuda'"),
        ("generator.weight_sync=nccl", r"^generator\.weight_sync: expected one of 'auto', 'messages', 'broadcast'"),
        ("rollout.max_total_tokens=99999", r"^rollout\.max_total_tokens: exceeds generator\.max_model_len"),
        ("env.name=alphabet_sort", r"^env\.name: must be 'module:Class'"),
        ("gateway.port=70000", r"^gateway\.port: must be in \[0, 65535\]"),
        ("gateway.host=''", r"^gateway\.host: must be an address to bind"),
        ("gateway.max_request_bytes=10", r"^gateway\.max_request_bytes: must be >= 1024"),
        ("gateway.max_messages=0", r"^gateway\.max_messages: must be >= 1"),
        ("controller.keep_checkpoints=1", r"^controller\.keep_checkpoints: must be 0 \(keep all\) or >= 2"),
        ("controller.keep_checkpoints=-1", r"^controller\.keep_checkpoints: must be 0 \(keep all\) or >= 2"),
        ("controller.restart_trainer=-1", r"^controller\.restart_trainer: must be >= 0 \(0 = off\), got -1$"),
        ("controller.restart_trainer=true", r"^controller\.restart_trainer: expected an integer"),
        ("gateway.render_threads=0", r"^gateway\.render_threads: must be >= 1"),
        ("controller.max_errored_steps=-1", r"^controller\.max_errored_steps: must be >= 0 \(0 = never stop\)"),
        ("model.lora.rank=-1", r"^model\.lora\.rank: must be >= 0 \(0: off\), got -1$"),
        ("model.lora.alpha=0", r"^model\.lora\.alpha: must be > 0"),
        ("model.lora.dropout=1.0", r"^model\.lora\.dropout: must be in \[0, 1\)"),
        ("model.lora.target_modules=['q_proj', 'qproj']", r"^model\.lora\.target_modules: 'qproj' is not a linear"),
        ("model.lora.target_modules=['experts']", r"^model\.lora\.target_modules: 'experts' is not a linear"),
        ("model.lora.target_modules=[]", r"^model\.lora\.target_modules: must name at least one"),
        ("model.lora.init_from='/x'", r"^model\.lora\.init_from: needs model\.lora\.rank > 0"),
        ("model.lora.ranks=8", r"^model\.lora\.ranks: unknown key"),
        ("trainer=3", r"^trainer: expected a table"),
        ("trainer.lr", r"expected key=value"),
    ],
)
def test_errors_name_the_offending_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_more_gpus_than_present_is_refused():
    overrides = ["controller.device=cuda", "trainer.ranks=4", "generator.replicas=4"]
    with pytest.raises(ConfigError, match=r"^controller\.device: .* = 8 GPUs, but 4 are visible"):
        load_config(overrides=overrides, available_gpus=4)
    assert load_config(overrides=overrides, available_gpus=8).generator.replicas == 4


def test_gpu_layout_separate_and_colocated():
    config = load_config(overrides=["controller.device=cuda", "generator.engine=vllm", "trainer.ranks=4",
                                    "generator.replicas=2", "generator.tp=2"], available_gpus=8)
    assert gpu_layout(config) == ([0, 1, 2, 3], [[4, 5], [6, 7]])
    single = ["controller.device=cuda", "controller.colocate=true", "trainer.ranks=1", "generator.replicas=1"]
    assert gpu_layout(load_config(overrides=single, available_gpus=1)) == ([0], [[0]])
    with pytest.raises(ConfigError, match=r"^controller\.device: max\(trainer\.ranks, .*\) = 2 GPUs, but 1"):
        load_config(overrides=single + ["generator.replicas=2"], available_gpus=1)


def test_broadcast_weight_sync_needs_generators_on_gpus_of_their_own():
    colocated = ["controller.device=cuda", "controller.colocate=true", "trainer.ranks=1", "generator.replicas=1"]
    assert load_config(overrides=colocated, available_gpus=1).generator.weight_sync == "messages"  # native
    with pytest.raises(ConfigError, match=r"^generator\.weight_sync: 'broadcast' needs generators on GPUs of"):
        load_config(overrides=[*colocated, "generator.weight_sync=broadcast"], available_gpus=1)


def test_weight_sync_auto_is_resolved_when_the_config_loads():
    vllm = ["controller.device=cuda", "generator.engine=vllm", "trainer.ranks=1", "generator.replicas=1"]
    own_gpus = load_config(overrides=vllm, available_gpus=2)
    assert own_gpus.generator.weight_sync == "broadcast"
    colocated = [*vllm, "controller.colocate=true"]
    assert load_config(overrides=colocated, available_gpus=1).generator.weight_sync == "messages"
    in_turns = [*colocated, "generator.sleep=true", 'controller.mode="sync"']
    assert load_config(overrides=in_turns, available_gpus=1).generator.weight_sync == "shared"
    assert load_config().generator.weight_sync == "messages"  # native replicas
    assert load_config(overrides=["generator.weight_sync=broadcast"]).generator.weight_sync == "broadcast"
    # A run's config.toml holds the resolved value, so a resume with the same settings sees no change.
    assert 'weight_sync = "broadcast"' in dump_toml(own_gpus)
    assert build_dataclass(Config, tomllib.loads(dump_toml(own_gpus))) == own_gpus


def test_gpu_layout_on_the_hosts_of_a_job():
    # 2 trainer nodes x 8 ranks, 2 generator nodes x 4 replicas of TP 2: ids count each node's GPUs.
    two_nodes_each = ["controller.device=cuda", "generator.engine=vllm", 'job.scheduler="slurm"', "job.trainer_hosts=2",
                      "job.generator_hosts=2", "trainer.ranks=16", "generator.replicas=8", "generator.tp=2"]
    per_node = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gpu_layout(load_config(overrides=two_nodes_each)) == (list(range(8)), per_node + per_node)
    with pytest.raises(ConfigError, match=r"^job\.gpus_per_host: a host needs 8 GPUs .* gets 4"):
        load_config(overrides=two_nodes_each + ["job.gpus_per_host=4"])
    slurm = load_config(overrides=two_nodes_each + ['job.partition="h200"', 'job.time_limit="1-12:00:00"',
                                                    "job.worker_port=29500"])
    assert (slurm.job.partition, slurm.job.time_limit, slurm.job.worker_port) == ("h200", "1-12:00:00", 29500)
    with pytest.raises(ConfigError, match=r"^job\.worker_port: must be a port \(1 to 65535\), got 65536$"):
        load_config(overrides=two_nodes_each + ["job.worker_port=65536"])


def test_generators_on_the_trainer_hosts_take_the_gpus_after_the_ranks():
    # job.generator_hosts = 0: one allocation of 2 nodes, each 4 trainer ranks then 2 replicas of TP 2.
    shared = ["controller.device=cuda", "generator.engine=vllm", 'job.scheduler="slurm"', "job.trainer_hosts=2",
              "job.generator_hosts=0", "trainer.ranks=8", "generator.replicas=4", "generator.tp=2"]
    config = load_config(overrides=shared)
    assert (config.job.shares_hosts, config.job.replica_hosts) == (True, 2)
    assert gpu_layout(config) == ([0, 1, 2, 3], [[4, 5], [6, 7], [4, 5], [6, 7]])
    with pytest.raises(ConfigError, match=r"^job\.gpus_per_host: a host needs 8 GPUs .* gets 6"):
        load_config(overrides=shared + ["job.gpus_per_host=6"])
    with pytest.raises(ConfigError, match=r"^generator\.replicas: 3 replicas do not split evenly over the "
                                          r"job\.trainer_hosts=2 \(job\.generator_hosts=0\)"):
        load_config(overrides=shared + ["generator.replicas=3"])
    with pytest.raises(ConfigError, match=r"^job\.generator_hosts: must be >= 0, got -1"):
        load_config(overrides=shared + ["job.generator_hosts=-1"])
    # On this host, 0 and 1 both mean this host.
    assert load_config(overrides=["job.generator_hosts=0"]).job.replica_hosts == 1


def test_child_gpus_stay_inside_the_parents_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_visible_devices([2, 3]) == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7")
    assert cuda_visible_devices([0]) == "4" and cuda_visible_devices([2, 3]) == "6,7"
    with pytest.raises(ValueError, match="exceed the 4 GPUs"):
        cuda_visible_devices([4])


def test_expandable_segments_are_read_from_the_allocator_settings_as_pytorch_reads_them(monkeypatch):
    assert expandable_segments("max_split_size_mb:512, expandable_segments:True")
    assert not expandable_segments("") and not expandable_segments("expandable_segments:False")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert expandable_segments()
    # Where both are set, PyTorch takes PYTORCH_CUDA_ALLOC_CONF.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments()
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # what PyTorch itself read
        reads = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
        read = subprocess.run([sys.executable, "-c", reads], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip()
        assert read == "expandable_segments:False"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_a_config_files_env_args_go_only_with_the_env_it_names(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[env]\nname = "rlactors_examples.alphabet_sort.env:AlphabetSortEnv"\nargs = { max_turns = 2 }\n')
    assert load_config(path).env.args == {"max_turns": 2}
    same = load_config(path, ['env.name="rlactors_examples.alphabet_sort.env:AlphabetSortEnv"'])
    assert same.env.args == {"max_turns": 2}
    other = load_config(path, ['env.name="my_envs.reverse:ReverseEnv"'])
    assert (other.env.name, other.env.args) == ("my_envs.reverse:ReverseEnv", {})
    # Overrides of env.args still apply, in either order, on top of the new env's defaults.
    for overrides in (['env.name="my_envs.reverse:ReverseEnv"', "env.args.depth=3"],
                      ["env.args.depth=3", 'env.name="my_envs.reverse:ReverseEnv"']):
        assert load_config(path, overrides).env.args == {"depth": 3}
    # A file without env.name wrote its args for the default env.
    path.write_text("[env]\nargs = { max_turns = 2 }\n")
    assert load_config(path, ['env.name="my_envs.reverse:ReverseEnv"']).env.args == {}
    assert load_config(path).env.args == {"max_turns": 2}


def test_lora_keys_load_round_trip_and_refuse_dropout_in_true_on_policy(tmp_path):
    config = load_config(overrides=["model.lora.rank=8", "model.lora.target_modules=['q_proj', 'v_proj']"])
    assert (config.model.lora.rank, config.model.lora.alpha, config.model.lora.target_modules) == (8, 16.0,
                                                                                                 ("q_proj", "v_proj"))
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config))
    assert load_config(path) == config
    with pytest.raises(ConfigError, match=r"^model\.lora\.dropout: must be 0 with model\.true_on_policy"):
        load_config(overrides=["model.lora.rank=8", "model.lora.dropout=0.1", "model.true_on_policy=true"])


def test_dump_round_trips(tmp_path):
    config = load_config(overrides=["env.args.names=['a', 'b']", "loss.name=dr_grpo"])
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config))
    assert load_config(path) == config
    assert build_dataclass(Config, tomllib.loads(dump_toml(config))) == config


# Strings a config may hold (the README's GSM8K prompt_template has a newline and a backslash).
AWKWARD_STRINGS = ["{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.",
                   'say "yes"', "a\ttab", "back\\slash\\", "trailing\\", "crlf\r\nline", "ünïcödé 数学 🙂",
                   "\x00\x01\x1f\x7f\b\f", "''' and \"\"\"", "#not a comment", "= [] {}", ""]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_round_trips_through_the_run_dirs_config_toml(tmp_path, path):
    config = load_config(path, available_gpus=8)
    written = tmp_path / "config.toml"
    written.write_text(dump_toml(config), encoding="utf-8")
    assert config_module.load_config(written, available_gpus=8) == config


def test_strings_with_newlines_quotes_tabs_backslashes_and_unicode_round_trip_exactly(tmp_path):
    args = {f"s{i}": text for i, text in enumerate(AWKWARD_STRINGS)}
    args.update({"list": AWKWARD_STRINGS, "nested": {"deep": {"x": AWKWARD_STRINGS[0]}, "k y": 1},
                 "odd key \n\"": "v", "": "empty key", "inf": float("inf"), "big": 1e300, "small": 5e-324})
    for text in AWKWARD_STRINGS[:8]:
        config = load_config(overrides=[f"controller.run_dir={_toml_literal(text or 'x')}",
                                        f"metrics.wandb_run={_toml_literal(text)}", "metrics.wandb_project=p"])
        config.env.args = args
        written = tmp_path / "config.toml"
        written.write_text(dump_toml(config), encoding="utf-8")
        assert config_module.read_toml(written)["env"]["args"] == args
        assert config_module.load_config(written) == config
        assert dump_toml(config_module.load_config(written)) == dump_toml(config)


def _toml_literal(text: str) -> str:
    """`text` as an override value (a TOML basic string), written independently of dump_toml."""
    return '"' + "".join(f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ch in '"\\\x7f' else ch for ch in text) + '"'


def test_config_read_errors_are_one_line(tmp_path):
    cases = {"newline.toml": ('[env]\nname = "a\nb"\n', "invalid TOML: Illegal character"),
             "not_utf8.toml": (b"[env]\nname = \"\xff\"\n", "not UTF-8 text (byte 14)"),
             "unclosed.toml": ("[trainer\nlr = 1", "invalid TOML: ")}
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ConfigError) as error:
            load_config(path)
        assert str(error.value).startswith(f"{path}: {message}") and "\n" not in str(error.value), error.value


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    # GPU configs are checked as if on an 8-GPU node.
    config = load_config(path, available_gpus=8)
    assert config.controller.steps >= 1


def test_the_moe_demo_config_names_the_tiny_mixture_of_experts_in_the_repository():
    from rlactors.models.checkpoint import check_checkpoint_dir

    root = Path(__file__).parent.parent
    config = config_module.load_config(root / "configs" / "moe_1gpu.toml", available_gpus=8)
    args = check_checkpoint_dir(root / config.model.path)
    assert (args.model_type, args.moe.num_experts, args.moe.num_experts_per_tok) == ("qwen3_moe", 8, 2)


def test_true_on_policy_with_vllm_is_tensor_parallel_1_only():
    vllm = ["controller.device=cuda", "generator.engine=vllm", "trainer.ranks=1", "generator.replicas=1"]
    with pytest.raises(ConfigError, match=r"^generator\.tp: model\.true_on_policy with vLLM runs tensor parallelism 1"):
        load_config(overrides=vllm + ["generator.tp=2", "model.true_on_policy=true"], available_gpus=8)
    assert load_config(overrides=vllm + ["generator.tp=2"], available_gpus=8).generator.tp == 2


def test_expert_parallel_divides_the_trainer_ranks():
    for expert_parallel in (1, 2, 4):
        config = load_config(overrides=["trainer.ranks=4", f"trainer.expert_parallel={expert_parallel}"])
        assert config.trainer.expert_parallel == expert_parallel
    for expert_parallel in (3, 8, 0):
        with pytest.raises(ConfigError, match=rf"^trainer\.expert_parallel: must be >= 1 and divide trainer\.ranks "
                                              rf"\(4\), got {expert_parallel}$"):
            load_config(overrides=["trainer.ranks=4", f"trainer.expert_parallel={expert_parallel}"])


def test_memory_knobs_are_checked_at_load():
    """Activation checkpointing, logprob chunking, optimizer offload, engines that sleep, the GPU size."""
    config = load_config(overrides=["trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=256",
                                    "trainer.offload_optimizer=true", "controller.gpu_memory_gib=79.6"])
    assert (config.trainer.activation_checkpointing, config.trainer.logprob_chunk_tokens,
            config.trainer.offload_optimizer, config.controller.gpu_memory_gib) == (True, 256, True, 79.6)
    for override, error in [("trainer.activation_checkpointing=1",
                             r"^trainer\.activation_checkpointing: expected a boolean"),
                            ("trainer.logprob_chunk_tokens=0", r"^trainer\.logprob_chunk_tokens: must be >= 1"),
                            ("trainer.offload_optimizer=\"yes\"", r"^trainer\.offload_optimizer: expected a boolean"),
                            ("controller.gpu_memory_gib=-1", r"^controller\.gpu_memory_gib: must be >= 0"),
                            ("generator.sleep=true", r"^generator\.sleep: .* it needs controller\.colocate = true$")]:
        with pytest.raises(ConfigError, match=error):
            load_config(overrides=[override])
    colocated = ['controller.device="cuda"', 'generator.engine="vllm"', "trainer.ranks=1", "generator.replicas=1",
                 "controller.colocate=true", "generator.sleep=true"]
    assert load_config(overrides=[*colocated, 'controller.mode="sync"'], available_gpus=1).generator.sleep
    with pytest.raises(ConfigError, match=r"^controller\.mode: must be 'sync' with generator\.sleep \(the engines "
                                          r"sleep while the trainer steps\)$"):
        load_config(overrides=[*colocated, 'controller.mode="async"'], available_gpus=1)


def test_lora_with_vllm_loads_at_tp_1_and_is_refused_at_tp_2():
    vllm = ["model.lora.rank=8", "generator.engine=vllm", 'controller.device="cuda"', "model.true_on_policy=true"]
    config = load_config(overrides=vllm, available_gpus=8)
    assert (config.model.lora.rank, config.generator.engine, config.generator.tp) == (8, "vllm", 1)
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank: with generator\.engine = 'vllm' needs "
                                          r"generator\.tp = 1 \(got 2; docs/lora\.md\)$"):
        load_config(overrides=[*vllm, "generator.tp=2"], available_gpus=8)


def test_shared_weight_sync_is_auto_for_one_vllm_replica_on_trainer_rank_0s_gpu_and_checked_at_load():
    colocated = ["controller.device=cuda", "generator.engine=vllm", "controller.colocate=true", "trainer.ranks=2",
                 "generator.sleep=true", 'controller.mode="sync"']
    assert load_config(overrides=[*colocated, "generator.replicas=1"], available_gpus=2).generator.weight_sync == \
        "shared"
    # Replica 1 would share trainer rank 1's GPU, not rank 0's, where the buffer is; TP 2 loads in other processes.
    for more in (["generator.replicas=2"], ["generator.replicas=1", "generator.tp=2"]):
        assert load_config(overrides=[*colocated, *more], available_gpus=2).generator.weight_sync == "messages"
    assert load_config(overrides=["generator.weight_sync=shared"]).generator.weight_sync == "shared"  # native, CPU
    for override in ['job.scheduler="slurm"', "model.lora.rank=8"]:
        with pytest.raises(ConfigError, match=r"^generator\.weight_sync: 'shared' needs the replicas on the trainer's "
                                              r"host \(not job\.scheduler = 'slurm'\), generator\.tp = 1, and no "
                                              r"model\.lora \(adapters go by 'messages'\)$"):
            load_config(overrides=["generator.weight_sync=shared", override])
