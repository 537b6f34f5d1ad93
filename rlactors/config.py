"""Typed run configuration: dataclasses, TOML files, `a.b=value` overrides.

Every value is checked once, when the config is built (each section checks its own values as it
is made, `Config.validate` the combinations when a file is loaded), so a wrong key, type or value
fails before any process is spawned, with a message that names the key (`trainer.lr: expected a
number, got 'x'`). Whoever holds a section holds a valid one and checks nothing again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# Here and not in rlactors.procs, which reads the config: the default of
# controller.unresponsive_timeout_s (rlactors.procs.liveness), and Monarch's own wait on a silent
# proc (rlactors.procs.supervision), which that timeout must stay well below.
UNRESPONSIVE_TIMEOUT_S = 60.0
MONARCH_STATE_QUERY_WAIT_S = 600

# The choices of the Literal fields that code outside this module also names.
UpdateMode = Literal["drain", "hot_swap"]
AdvantageMethod = Literal["grpo", "dr_grpo"]
LossName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo", "sft"]
CorrectionLevel = Literal["token", "sequence"]


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or impossible."""


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


class _Section:
    """A section of the Config (`[model]`, `[trainer]`, ...): its values are checked when it is made."""

    def __post_init__(self) -> None:
        self.validate(_section_keys()[type(self)])

    def validate(self, key: str) -> None:
        """Raises ConfigError naming `key.field` for a value that is impossible on its own."""


# --- LoRA (model.lora; docs/lora.md) ---------------------------------------------------------
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """`model.lora`: train low-rank adapters on the targeted linears over a frozen base (rank 0: off)."""

    rank: int = 0
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input, in training (the default mode only)
    target_modules: tuple[str, ...] = LORA_TARGETS  # the decoder layers' linears that get adapters
    init_from: str = ""  # a PEFT LoRA adapter dir to start from ("": A random, B zero)

    def __post_init__(self) -> None:
        key = "model.lora"
        _check(self.rank >= 0, f"{key}.rank", f"must be >= 0 (0: off), got {self.rank}")
        _check(0 < self.alpha < math.inf, f"{key}.alpha", f"must be > 0 and finite, got {self.alpha}")
        _check(0 <= self.dropout < 1, f"{key}.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(bool(self.target_modules), f"{key}.target_modules", "must name at least one linear")
        for name in self.target_modules:
            _check(name in LORA_TARGETS, f"{key}.target_modules",
                   f"{name!r} is not a linear adapters can target (one of {', '.join(LORA_TARGETS)}; "
                   "experts and the LM head are not)")
        _check(not self.init_from or self.rank > 0, f"{key}.init_from", f"needs {key}.rank > 0")


@dataclass
class ModelConfig(_Section):
    path: str  # an HF checkpoint dir
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # generator/compute dtype
    true_on_policy: bool = False  # batch-invariant kernels: trainer logprobs == generator's
    # Mixture-of-experts models: the trainer routes each sampled token to the generator's experts
    # (R3); true on-policy routes them alike without it
    routing_replay: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self, key: str) -> None:
        _check(bool(self.path), f"{key}.path", "must name a checkpoint directory")
        _check(not (self.routing_replay and self.true_on_policy), f"{key}.routing_replay",
               f"is for the default mode: with {key}.true_on_policy the trainer routes every token as the "
               "generator did already")
        _check(not (self.lora.dropout and self.true_on_policy), f"{key}.lora.dropout",
               f"must be 0 with {key}.true_on_policy (the generator samples without dropout)")


@dataclass
class TrainerConfig(_Section):
    ranks: int = 2  # trainer procs; one GPU each on CUDA
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    mixed_precision: bool = True  # bf16 compute with fp32 master weights on CUDA
    activation_checkpointing: bool = False
    compile_layers: bool = True  # CUDA: torch.compile each decoder layer (not in model.true_on_policy)
    logprob_chunk_tokens: int = 1024  # tokens per chunk of the fp32 log-softmax
    # AdamW's moments in pinned host memory between steps, brought to the GPU one layer at a time
    # for the step (rlactors.trainer.offload)
    offload_optimizer: bool = False
    # Mixture-of-experts models: weight of the router's load-balancing loss (0: off, as RL recipes run)
    router_aux_loss_coef: float = 0.0
    # Mixture-of-experts models: consecutive ranks each sparse layer's experts are split over, by
    # expert (1: FSDP shards them with the rest; a divisor E of trainer.ranks: ranks/E groups of E
    # ranks, each holding all the experts)
    expert_parallel: int = 1

    def validate(self, key: str) -> None:
        _check(self.ranks >= 1, f"{key}.ranks", f"must be >= 1, got {self.ranks}")
        _check(0 < self.lr < math.inf, f"{key}.lr", f"must be > 0 and finite, got {self.lr}")
        _check(all(0 <= b < 1 for b in self.betas), f"{key}.betas", f"each must be in [0, 1), got {self.betas}")
        _check(0 <= self.weight_decay < math.inf, f"{key}.weight_decay", "must be >= 0 and finite")
        _check(self.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        _check(self.max_grad_norm > 0, f"{key}.max_grad_norm", "must be > 0")
        _check(self.logprob_chunk_tokens >= 1, f"{key}.logprob_chunk_tokens", "must be >= 1")
        _check(0 <= self.router_aux_loss_coef < math.inf, f"{key}.router_aux_loss_coef",
               f"must be >= 0 and finite, got {self.router_aux_loss_coef}")
        _check(self.expert_parallel >= 1 and self.ranks % self.expert_parallel == 0, f"{key}.expert_parallel",
               f"must be >= 1 and divide trainer.ranks ({self.ranks}), got {self.expert_parallel}")


@dataclass
class GeneratorConfig(_Section):
    engine: Literal["native", "vllm"] = "native"
    replicas: int = 2
    tp: int = 1  # GPUs per replica (vllm)
    max_num_seqs: int = 64  # sequences decoded together
    max_num_tokens: int = 2048  # tokens per engine step (prefill chunks + decodes)
    kv_cache_tokens: int = 16384  # native KV cache budget, in tokens
    block_size: int = 16  # native KV cache block, in tokens
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5  # vllm
    update_mode: UpdateMode = "drain"
    restart_dead: bool = True
    # How weights reach the replicas: "messages" (full tensors over Monarch; a dead replica is
    # restarted at the current version) or "broadcast" (one packed buffer from trainer rank 0:
    # NCCL on GPUs, gloo on CPU; faster; its group is formed again after a replica dies or restarts).
    # "shared": trainer rank 0 packs into a buffer that the replicas on its host map (CUDA IPC on
    # GPU, shared memory on CPU); each push sends only (version, checksum).
    # "auto": broadcast for vLLM replicas on GPUs of their own (NCCL cannot join two ranks on one
    # GPU), shared for one vLLM replica of one GPU colocated in turns (generator.sleep) on trainer
    # rank 0's, messages otherwise; resolved when the Config is made. (A shared push returns once
    # the replica loaded it: free in turns, where the engine is idle; in async mode the trainer
    # would wait for the replica's drain.)
    weight_sync: Literal["auto", "messages", "broadcast", "shared"] = "auto"
    # controller.colocate: the engines sleep (KV cache freed, vLLM's weights to host memory) while
    # the trainer steps, and wake for generation (rlactors.run.turns)
    sleep: bool = False

    def validate(self, key: str) -> None:
        for name in ("replicas", "tp", "max_num_seqs", "max_num_tokens", "kv_cache_tokens", "block_size"):
            value = getattr(self, name)
            _check(value >= 1, f"{key}.{name}", f"must be >= 1, got {value}")
        _check(self.max_model_len >= 2, f"{key}.max_model_len", "must be >= 2")
        _check(self.kv_cache_tokens >= self.max_model_len, f"{key}.kv_cache_tokens",
               f"must hold at least one full sequence (max_model_len={self.max_model_len})")
        _check(0 < self.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization", "must be in (0, 1]")
        _check(self.engine == "vllm" or self.tp == 1, f"{key}.tp", "tensor parallelism needs engine = 'vllm'")


@dataclass
class RolloutConfig(_Section):
    group_size: int = 8  # rollouts per prompt (G)
    prompts_per_step: int = 8
    max_turns: int = 3
    max_total_tokens: int = 1024  # prompt + all turns of one rollout
    max_tokens_per_turn: int = 128
    step_timeout_s: float = 30.0  # one env reset/step
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    advantage: AdvantageMethod = "grpo"
    keep_zero_variance_groups: bool = False
    error_reward: float = 0.0
    # Over-long responses, as in DAPO. mask_truncated: rollouts cut by a token limit
    # (truncated_length) are not trained, but keep their reward in their group's advantages.
    # overlong_buffer_tokens > 0: a completion longer than max_tokens_per_turn minus that many
    # tokens loses reward linearly, up to overlong_penalty at the limit (component "overlong").
    mask_truncated: bool = False
    overlong_buffer_tokens: int = 0
    overlong_penalty: float = 1.0

    def validate(self, key: str) -> None:
        for name in ("group_size", "prompts_per_step", "max_turns", "max_total_tokens", "max_tokens_per_turn"):
            value = getattr(self, name)
            _check(value >= 1, f"{key}.{name}", f"must be >= 1, got {value}")
        _check(0 <= self.overlong_buffer_tokens <= self.max_tokens_per_turn, f"{key}.overlong_buffer_tokens",
               f"must be in [0, max_tokens_per_turn={self.max_tokens_per_turn}], got {self.overlong_buffer_tokens}")
        _check(0 <= self.overlong_penalty < math.inf, f"{key}.overlong_penalty",
               f"must be >= 0 and finite, got {self.overlong_penalty}")
        _check(self.step_timeout_s > 0, f"{key}.step_timeout_s", "must be > 0")
        _check(0 < self.temperature < math.inf, f"{key}.temperature", "must be > 0 and finite")
        _check(0 < self.top_p <= 1, f"{key}.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, f"{key}.top_k", "must be >= 0")
        _check(math.isfinite(self.error_reward), f"{key}.error_reward", f"must be finite, got {self.error_reward}")
        _check(self.advantage != "grpo" or self.group_size >= 2, f"{key}.group_size",
               "GRPO advantages need at least 2 rollouts per prompt")


@dataclass
class BatcherConfig(_Section):
    row_tokens: int = 1024  # token budget of one packed row
    rows_per_microbatch: int = 4
    overlong: Literal["truncate", "drop"] = "truncate"

    def validate(self, key: str) -> None:
        _check(self.row_tokens >= 2, f"{key}.row_tokens", "must be >= 2")
        _check(self.rows_per_microbatch >= 1, f"{key}.rows_per_microbatch", "must be >= 1")


@dataclass
class LossConfig(_Section):
    """The loss and its corrections; docs/algorithms.md gives each one's formula."""

    name: LossName = "grpo"
    clip_low: float = 0.2  # 1 = no lower bound (CISPO's usual setting)
    clip_high: float = 0.2  # DAPO uses a higher upper clip, e.g. 0.28; GSPO ~4e-4, CISPO ~0.28
    # Trainer/generator mismatch (and async lag): the ratio p_trainer / p_generator, per token or per
    # sequence (geometric mean over its loss tokens). tis_cap truncates it into an IS weight;
    # [is_mask_low, is_mask_high] keeps the tokens (sequences) whose ratio lies inside it.
    tis_cap: float = 0.0  # 0 = off
    tis_level: CorrectionLevel = "token"
    is_mask_low: float = 0.0
    is_mask_high: float = 0.0  # 0 = off
    is_mask_level: CorrectionLevel = "token"
    # KL to the initial policy, held frozen by the trainer (in model.dtype): 0 = off (no copy).
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_as: Literal["loss", "reward"] = "loss"  # a loss term, or a per-token penalty on the advantage

    @property
    def corrects_mismatch(self) -> bool:
        return self.tis_cap > 0 or self.is_mask_high > 0

    def validate(self, key: str) -> None:
        _check(0 <= self.clip_low <= 1, f"{key}.clip_low", f"must be in [0, 1], got {self.clip_low}")
        _check(0 <= self.clip_high < math.inf, f"{key}.clip_high", f"must be >= 0 and finite, got {self.clip_high}")
        _check(self.tis_cap == 0 or self.tis_cap >= 1, f"{key}.tis_cap", "must be 0 (off) or >= 1")
        _check(self.tis_level == "token" or self.tis_cap > 0, f"{key}.tis_level",
               f"is {self.tis_level!r}, but {key}.tis_cap is 0 (off)")
        _check(self.is_mask_high == 0 or 1 <= self.is_mask_high, f"{key}.is_mask_high",
               f"must be 0 (off) or >= 1, got {self.is_mask_high}")
        _check(0 <= self.is_mask_low <= 1 and (self.is_mask_low == 0 or self.is_mask_high > 0), f"{key}.is_mask_low",
               f"must be in [0, 1], and 0 while {key}.is_mask_high is 0 (off), got {self.is_mask_low}")
        _check(self.is_mask_level == "token" or self.is_mask_high > 0, f"{key}.is_mask_level",
               f"is {self.is_mask_level!r}, but {key}.is_mask_high is 0 (off)")
        _check(0 <= self.kl_coef < math.inf, f"{key}.kl_coef", f"must be >= 0 and finite, got {self.kl_coef}")
        if self.name == "sft":
            for name in ("tis_cap", "is_mask_high", "kl_coef"):
                _check(getattr(self, name) == 0, f"{key}.{name}", "is for policy losses, not 'sft'")


@dataclass
class TeacherConfig(_Section):
    """On-policy distillation: a teacher with the student's tokenizer, frozen on procs of its own
    (in model.dtype), scores the sampled tokens; each token's advantage becomes
    task_coef * A - coef * (log p_student - log p_teacher) (docs/algorithms.md)."""

    path: str = ""  # an HF checkpoint dir of any supported family; "" = off
    coef: float = 1.0
    task_coef: float = 1.0  # the task reward's share; 0 = distillation alone

    def validate(self, key: str) -> None:
        _check(0 < self.coef < math.inf, f"{key}.coef", f"must be > 0 and finite, got {self.coef}")
        _check(0 <= self.task_coef < math.inf, f"{key}.task_coef", f"must be >= 0 and finite, got {self.task_coef}")


@dataclass
class ControllerConfig(_Section):
    device: Literal["cpu", "cuda"] = "cpu"
    colocate: bool = False  # CUDA: generators share the trainer's GPUs (single-GPU machines)
    steps: int = 20
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1  # async: oldest policy version an episode may come from, in versions
    checkpoint_every: int = 0  # steps; 0 = only at the end
    keep_checkpoints: int = 0  # the newest this many complete checkpoints are kept; 0 = all (>= 2: a fallback)
    eval_every: int = 0  # steps; evaluates at step 0, every eval_every steps and at the end ([eval]); 0 = off
    run_dir: str = "runs/alphabet_sort"
    seed: int = 0
    log_samples: bool = True
    # A proc that stops answering (stopped, CPU-starved, in a long call) is slow, not dead, until
    # it has been silent this long; one whose process exits is dead at once (rlactors.procs.liveness).
    unresponsive_timeout_s: float = UNRESPONSIVE_TIMEOUT_S
    # How many times a run rebuilds its trainer from the last checkpoint after a trainer rank died
    # (rlactors.run.recovery); 0: the run stops, to be continued with --resume.
    restart_trainer: int = 0
    # One GPU's memory for the memory plan (rlactors.run.memory_plan); 0: the device's, where CUDA is
    gpu_memory_gib: float = 0.0
    # Steps in a row in which every rollout ended in an error (a broken env or harness) before the
    # run stops, saved, naming the error; 0 = never stop.
    max_errored_steps: int = 3

    def validate(self, key: str) -> None:
        _check(0 <= self.gpu_memory_gib < math.inf, f"{key}.gpu_memory_gib",
               f"must be >= 0 (0 = the device's) and finite, got {self.gpu_memory_gib}")
        _check(self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")
        _check(self.restart_trainer >= 0, f"{key}.restart_trainer",
               f"must be >= 0 (0 = off), got {self.restart_trainer}")
        most = MONARCH_STATE_QUERY_WAIT_S / 2  # Monarch's own verdict on a silent proc must come later
        _check(5 <= self.unresponsive_timeout_s <= most, f"{key}.unresponsive_timeout_s",
               f"must be between 5 and {most:g} s, got {self.unresponsive_timeout_s}")
        _check(self.max_staleness >= 0, f"{key}.max_staleness", "must be >= 0")
        _check(self.checkpoint_every >= 0, f"{key}.checkpoint_every", "must be >= 0")
        _check(self.keep_checkpoints == 0 or self.keep_checkpoints >= 2, f"{key}.keep_checkpoints",
               f"must be 0 (keep all) or >= 2 (an intact one to fall back to), got {self.keep_checkpoints}")
        _check(self.eval_every >= 0, f"{key}.eval_every", f"must be >= 0 (0 = off), got {self.eval_every}")
        _check(bool(self.run_dir), f"{key}.run_dir", "must not be empty")
        _check(self.seed >= 0, f"{key}.seed", f"must be >= 0, got {self.seed}")
        _check(self.max_errored_steps >= 0, f"{key}.max_errored_steps",
               f"must be >= 0 (0 = never stop), got {self.max_errored_steps}")

    def checkpoint_due(self, step: int) -> bool:
        """Whether the run checkpoints after `step`: every `checkpoint_every` steps, and the last."""
        return (self.checkpoint_every > 0 and step % self.checkpoint_every == 0) or step == self.steps


@dataclass
class EvalConfig(_Section):
    """Evaluation on the env's eval split (`controller.eval_every`, `python -m rlactors.evaluate`).
    Rollouts follow [rollout]'s turn and token limits; sampling is this section's own."""

    samples: int = 0  # the first this many samples of the eval split; 0 = all of it
    samples_per_prompt: int = 1  # k of pass@k
    temperature: float = 0.0  # 0 = greedy; top-p and top-k are off
    pass_reward: float = 1.0  # a rollout passes (pass@k) when its reward is at least this

    def validate(self, key: str) -> None:
        _check(self.samples >= 0, f"{key}.samples", f"must be >= 0 (0 = the whole eval split), got {self.samples}")
        _check(self.samples_per_prompt >= 1, f"{key}.samples_per_prompt",
               f"must be >= 1, got {self.samples_per_prompt}")
        _check(0 <= self.temperature < math.inf, f"{key}.temperature", "must be >= 0 (0 = greedy) and finite")
        _check(math.isfinite(self.pass_reward), f"{key}.pass_reward", f"must be finite, got {self.pass_reward}")


@dataclass
class MetricsConfig(_Section):
    """Sinks beyond metrics.jsonl and TensorBoard: Weights & Biases when `wandb_project` is set
    (`pip install -e ".[wandb]"`; offline with WANDB_MODE=offline)."""

    wandb_project: str = ""  # "" = no W&B
    wandb_run: str = ""  # the W&B run's name; "" = the run dir's name

    def validate(self, key: str) -> None:
        # W&B refuses these in project names (and names longer than 128 characters).
        _check(len(self.wandb_project) <= 128 and not set(self.wandb_project) & set("/\\#?%:"),
               f"{key}.wandb_project", f"W&B project names have at most 128 characters and none of / \\ # ? % :, "
               f"got {self.wandb_project!r}")
        _check(not self.wandb_run or bool(self.wandb_project), f"{key}.wandb_run",
               "names a W&B run, but metrics.wandb_project is not set")


@dataclass
class JobConfig(_Section):
    """Where the meshes run. 'local': every proc on this host. 'process': each host is a worker
    process of a Monarch ProcessJob on this machine (CPU: tries a multi-host layout, and the tests
    run one). 'slurm': the hosts of a Monarch SlurmJob, one sbatch allocation for the run, of
    trainer_hosts + generator_hosts nodes."""

    scheduler: Literal["local", "process", "slurm"] = "local"
    trainer_hosts: int = 1  # trainer.ranks are split evenly over them
    # generator.replicas are split evenly over them; 0: over the trainer hosts, after their ranks' GPUs
    generator_hosts: int = 1
    gpus_per_host: int = 8  # slurm: GPUs each node is asked for
    partition: str = ""  # slurm; "" = the cluster's default
    time_limit: str = ""  # slurm, HH:MM:SS; "" = the partition's default
    worker_port: int = 22222  # slurm: the port of the Monarch worker on every node (one run a node per port)

    @property
    def shares_hosts(self) -> bool:
        """The generator replicas run on the trainer's hosts."""
        return self.scheduler == "local" or self.generator_hosts == 0

    @property
    def replica_hosts(self) -> int:
        """The hosts the generator replicas are split over."""
        return self.generator_hosts or self.trainer_hosts

    def validate(self, key: str) -> None:
        for name, least in (("trainer_hosts", 1), ("generator_hosts", 0), ("gpus_per_host", 1)):
            value = getattr(self, name)
            _check(value >= least, f"{key}.{name}", f"must be >= {least}, got {value}")
        _check(not any(ch.isspace() for ch in self.partition), f"{key}.partition",
               f"must be a partition name, got {self.partition!r}")
        _check(0 < self.worker_port < 65536, f"{key}.worker_port",
               f"must be a port (1 to 65535), got {self.worker_port}")
        _check(not self.time_limit or re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time_limit) is not None,
               f"{key}.time_limit", f"expected Slurm's [D-]HH:MM:SS (or MM, HH:MM), got {self.time_limit!r}")
        if self.scheduler == "local":
            for name, allowed in (("trainer_hosts", (1,)), ("generator_hosts", (0, 1))):
                _check(getattr(self, name) in allowed, f"{key}.{name}",
                       "scheduler 'local' runs on this host only: set job.scheduler to 'process' or 'slurm'")


@dataclass
class GatewayConfig(_Section):
    """The OpenAI-compatible gateway that an AgentEnv's harnesses call (rlactors.gateway); started
    only for an AgentEnv. Requests are bounded here and by rollout.max_tokens_per_turn."""

    host: str = "127.0.0.1"  # "0.0.0.0" serves harnesses on other machines too
    port: int = 0  # 0 = a free port, chosen at start
    max_request_bytes: int = 4 << 20
    max_messages: int = 512
    render_threads: int = 2  # large requests are rendered and tokenized on this many threads, off the event loop

    def validate(self, key: str) -> None:
        _check(bool(self.host) and not any(ch.isspace() for ch in self.host), f"{key}.host",
               f"must be an address to bind, got {self.host!r}")
        _check(0 <= self.port <= 65535, f"{key}.port", f"must be in [0, 65535] (0 = any free port), got {self.port}")
        _check(self.max_request_bytes >= 1024, f"{key}.max_request_bytes",
               f"must be >= 1024, got {self.max_request_bytes}")
        _check(self.max_messages >= 1, f"{key}.max_messages", f"must be >= 1, got {self.max_messages}")
        _check(self.render_threads >= 1, f"{key}.render_threads", f"must be >= 1, got {self.render_threads}")


@dataclass
class EnvConfig(_Section):
    name: str = "rlactors_examples.alphabet_sort.env:AlphabetSortEnv"  # "module:Class"
    # Checked by the env's own Config. A config file's args go with the env it names: overriding
    # env.name drops them (load_config).
    args: dict[str, Any] = field(default_factory=dict)

    def validate(self, key: str) -> None:
        _check(":" in self.name, f"{key}.name", f"must be 'module:Class', got {self.name!r}")


@dataclass
class Config:
    model: ModelConfig  # model.path has no default: a run names its checkpoint
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    job: JobConfig = field(default_factory=JobConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        g = self.generator
        if g.weight_sync == "auto":
            variant = "messages"
            if g.engine == "vllm" and not self.controller.colocate:
                variant = "broadcast"
            elif g.engine == "vllm" and g.sleep and g.replicas == 1 and g.tp == 1 and not self.model.lora.rank:
                variant = "shared"  # colocated in turns: the replica shares trainer rank 0's GPU
            self.generator = dataclasses.replace(g, weight_sync=variant)

    def validate(self, available_gpus: int | None = None) -> None:
        """Checks the combinations of the sections' values (each section checked its own when it
        was made); `available_gpus` defaults to this host's."""
        c = self
        _check(not c.teacher.path or c.loss.name != "sft", "teacher.path", "distills into a policy loss, not 'sft'")
        _check(c.rollout.max_total_tokens <= c.generator.max_model_len, "rollout.max_total_tokens",
               f"exceeds generator.max_model_len ({c.generator.max_model_len})")
        _check(c.rollout.max_tokens_per_turn <= c.rollout.max_total_tokens, "rollout.max_tokens_per_turn",
               f"exceeds rollout.max_total_tokens ({c.rollout.max_total_tokens})")
        _check(not (c.model.lora.rank and c.generator.engine == "vllm" and c.generator.tp > 1), "model.lora.rank",
               f"with generator.engine = 'vllm' needs generator.tp = 1 (got {c.generator.tp}; docs/lora.md)")
        # Sampling seeds are ((controller.seed << 32) + rollout number) * max_turns + turn (Rollouter).
        _check(((c.controller.seed + 1) << 32) * c.rollout.max_turns <= 2**63, "controller.seed",
               f"too large: with rollout.max_turns={c.rollout.max_turns} the sampling seeds overflow 63 bits")
        j = c.job
        _check(c.trainer.ranks % j.trainer_hosts == 0, "trainer.ranks",
               f"{c.trainer.ranks} ranks do not split evenly over job.trainer_hosts={j.trainer_hosts}")
        hosts = f"job.generator_hosts={j.generator_hosts}" if j.generator_hosts else \
            f"the job.trainer_hosts={j.trainer_hosts} (job.generator_hosts=0)"
        _check(c.generator.replicas % j.replica_hosts == 0, "generator.replicas",
               f"{c.generator.replicas} replicas do not split evenly over {hosts}")
        _check(not c.generator.sleep or c.controller.colocate, "generator.sleep",
               "the engines sleep to lend the trainer their GPUs: it needs controller.colocate = true")
        # Asleep, the engines serve nothing: the trainer's phase and generation take turns, so
        # there is no generation ahead of the trainer for async to overlap.
        _check(not c.generator.sleep or c.controller.mode == "sync", "controller.mode",
               "must be 'sync' with generator.sleep (the engines sleep while the trainer steps)")
        _check(c.generator.weight_sync != "broadcast" or not c.controller.colocate, "generator.weight_sync",
               "'broadcast' needs generators on GPUs of their own (controller.colocate is set)")
        shared = c.generator.weight_sync == "shared"
        _check(not shared or (j.scheduler != "slurm" and c.generator.tp == 1 and not c.model.lora.rank),
               "generator.weight_sync", "'shared' needs the replicas on the trainer's host (not job.scheduler = "
               "'slurm'), generator.tp = 1, and no model.lora (adapters go by 'messages')")
        # vLLM runs our own model in true on-policy mode (rlactors.on_policy.vllm_model), unsharded.
        _check(not (c.model.true_on_policy and c.generator.engine == "vllm" and c.generator.tp > 1), "generator.tp",
               "model.true_on_policy with vLLM runs tensor parallelism 1 only")
        if c.controller.device == "cpu":
            _check(c.generator.engine == "native", "generator.engine", "'vllm' needs controller.device = 'cuda'")
            return
        _check(j.scheduler != "process", "job.scheduler",
               "'process' hosts all share this machine's GPUs: use 'local' on one node, 'slurm' on several")
        _check(j.scheduler == "local" or not c.controller.colocate, "controller.colocate",
               "generators share the trainer's GPUs only on one host (job.scheduler = 'local')")
        trainer_gpus, replica_gpus = gpu_layout(c)
        if j.scheduler == "slurm":
            per_host = max(len(trainer_gpus), max(r[-1] for r in replica_gpus) + 1)
            _check(per_host <= j.gpus_per_host, "job.gpus_per_host",
                   f"a host needs {per_host} GPUs for its trainer ranks or replicas, but gets {j.gpus_per_host}")
            return
        if available_gpus is None:
            import torch

            available_gpus = torch.cuda.device_count()
        wanted = len(set(trainer_gpus).union(*replica_gpus))
        formula = "max(trainer.ranks, generator.replicas * generator.tp)" if c.controller.colocate else \
            "trainer.ranks + generator.replicas * generator.tp"
        _check(wanted <= available_gpus, "controller.device",
               f"{formula} = {wanted} GPUs, but {available_gpus} are visible")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_model_keys(model: ModelConfig, trainer: TrainerConfig, args: Any) -> None:
    """Checks the keys that depend on the checkpoint in `model.path` (`args`, its config: a
    rlactors.models.args.ModelArgs, which this bottom module does not import)."""
    if args.moe is None:
        no_experts = f"{model.path} ({args.model_type}) has no experts"
        _check(trainer.router_aux_loss_coef == 0, "trainer.router_aux_loss_coef",
               f"is {trainer.router_aux_loss_coef}, but {no_experts}")
        _check(not model.routing_replay, "model.routing_replay", f"is set, but {no_experts}")
        _check(trainer.expert_parallel == 1, "trainer.expert_parallel",
               f"is {trainer.expert_parallel}, but {no_experts}")
        return
    _check(args.moe.num_experts % trainer.expert_parallel == 0, "trainer.expert_parallel",
           f"{trainer.expert_parallel} ranks cannot split the {args.moe.num_experts} experts evenly")


@functools.cache
def _section_keys() -> dict[type, str]:
    """Each section's class -> its key in the Config (ModelConfig -> "model")."""
    return {hint: name for name, hint in typing.get_type_hints(Config).items()}


# ---------------------------------------------------------------------------------------------
# Loading


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp`; returns it in the annotated type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        _check(value in typing.get_args(tp), key, f"expected {_type_name(tp)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        last_error = None
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                last_error = e
        raise last_error or ConfigError(f"{key}: unexpected value {value!r}")
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        _check(isinstance(value, (list, tuple)), key, f"expected a list, got {value!r}")
        return tuple(_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(tp)
        ok = isinstance(value, (list, tuple)) and len(value) == len(args)
        _check(ok, key, f"expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        _check(isinstance(value, dict), key, f"expected a table, got {value!r}")
        return dict(value)
    if tp is bool:
        _check(isinstance(value, bool), key, f"expected a boolean, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        _check(ok, key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key)
    raise TypeError(f"{key}: unsupported config annotation {tp!r}")


def build_dataclass(cls: type, values: dict[str, Any], key: str = "") -> Any:
    """Builds `cls` from a plain dict, rejecting unknown keys and wrong types by their full key."""
    where = f"{key}." if key else ""
    _check(isinstance(values, dict), key or cls.__name__, f"expected a table, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise ConfigError(f"{where}{name}: unknown key (known: {', '.join(sorted(known))})")
    kwargs = {name: _coerce(v, hints[name], f"{where}{name}") for name, v in values.items()}
    for f in dataclasses.fields(cls):
        if f.name in kwargs or f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if dataclasses.is_dataclass(hints[f.name]):  # a section with a required key
            kwargs[f.name] = build_dataclass(hints[f.name], {}, f"{where}{f.name}")
        else:
            raise ConfigError(f"{where}{f.name}: missing; it has no default (set it in the config file, "
                              f"or as {where}{f.name}=...)")
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is read as TOML, else taken as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. trainer.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    _check(bool(key) and all(key.split(".")), key or text, "override key must be dotted, e.g. trainer.lr")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        _check(isinstance(node, dict), ".".join(path), f"{part!r} is not a table")
    node[path[-1]] = value


def _drop_args_of_another_env(tree: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> None:
    """A file's `env.args` belong to the env the file names: an override naming another env
    starts from that env's defaults (plus any `env.args` overrides)."""
    env = tree.get("env")
    if not isinstance(env, dict) or "args" not in env:
        return
    written_for = env.get("name", EnvConfig.name)
    if any(keys == ["env", "name"] and value != written_for for keys, value in overrides):
        del env["args"]


def load_config(path: str | Path | None = None, overrides: list[str] = (), available_gpus: int | None = None,
                base: str | Path | None = None) -> Config:
    """Loads a TOML file (or the defaults), applies overrides, builds and validates the Config.

    `base` (a run's config.toml, on --resume) is read first and the file's keys go on top of it.
    An override of `env.name` naming another env than the file's drops the file's `env.args`:
    they were written for its env."""
    tree: dict[str, Any] = read_toml(base) if base is not None else {}
    if path is not None:
        for section, table in read_toml(path).items():
            if isinstance(table, dict) and isinstance(tree.get(section), dict):
                tree[section].update(table)
            else:
                tree[section] = table
    parsed = [parse_override(text) for text in overrides]
    _drop_args_of_another_env(tree, parsed)
    for keys, value in parsed:
        _set_path(tree, keys, value)
    config = build_dataclass(Config, tree)
    config.validate(available_gpus)
    return config


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path` (UTF-8) as a dict; ConfigError, one line, when it is missing or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {' '.join(str(e).split())}") from None


# TOML's short escapes; every other control character is written as \uXXXX.
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_string(text: str) -> str:
    """`text` as a TOML basic string: one line, read back exactly."""
    escaped = (_TOML_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
               for ch in text)
    return '"' + "".join(escaped) + '"'


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # inf, -inf and nan are spelled as TOML spells them
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (datetime.date, datetime.time)):  # TOML's dates and times (datetime too)
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(config: Config) -> str:
    """The config as TOML text (written into each run dir, as UTF-8, so a run can be reproduced
    and resumed): `read_toml` of it builds the same Config."""
    lines = []
    for section, table in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def gpu_layout(config: Config) -> tuple[list[int], list[list[int]]]:
    """GPU ids, counted on their own host, of the trainer ranks of one trainer host and of each
    generator replica (its TP group).

    Where replicas share the trainer's hosts (one host, or job.generator_hosts = 0), trainers
    take the first GPUs of each and replicas the following ones, or, with `controller.colocate`,
    the same ones from GPU 0 on (the generator then uses only gpu_memory_utilization of each).
    Where each mesh has hosts of its own, every trainer host uses GPUs 0.., and replica r is the
    (r % per host)-th of its host.
    """
    j = config.job
    tp = config.generator.tp
    ranks_per_host = config.trainer.ranks // j.trainer_hosts
    replicas_per_host = config.generator.replicas // j.replica_hosts
    first = ranks_per_host if j.shares_hosts and not config.controller.colocate else 0
    trainer = list(range(ranks_per_host))
    replicas = [list(range(first + (r % replicas_per_host) * tp, first + (r % replicas_per_host + 1) * tp))
                for r in range(config.generator.replicas)]
    return trainer, replicas
