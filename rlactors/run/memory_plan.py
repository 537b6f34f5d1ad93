"""The memory plan: what one GPU holds for a run, from the Config and the checkpoint's config.json.

Pure arithmetic, before anything spawns (`python -m rlactors.train --config F --plan` prints it;
`Controller.start` refuses a run that cannot fit, in one line naming the keys to change).

Per trainer rank (FSDP2): fp32 master weights, gradients and AdamW moments of what trains (with
`model.lora` the adapters, beside the frozen base), compute copies, activations, the LM head's
chunk, the weight sync's buffer, the frozen reference policy (`loss.kl_coef`) and the CUDA
context; on each trainer host's first GPU, the teacher's proc (`teacher.path`). Per vLLM replica
GPU: its `gpu_memory_utilization` share plus what it holds beyond it. Colocated with
`generator.sleep` the GPU is held in turns (rlactors.run.turns): training, syncing and generation;
the plan is the largest phase. docs/model_sizes.md has the formulas.
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rlactors.config import Config, ConfigError, LoraConfig
from rlactors.models.args import DTYPES, ModelArgs

GIB = 2**30
# Every trainer process beside its tensors: the CUDA context, cuBLAS and NCCL workspaces, allocator
# slack (0.8 GiB seen at the 8B shape after loading: benchmarks/results/notes/colocated_scale.md).
CUDA_CONTEXT_GIB = 1.0
# vLLM's own use inside its share beside weights and KV cache: profiled activations, sampler,
# CUDA graphs.
VLLM_RUNTIME_GIB = 2.0
# What a vLLM process holds outside its gpu_memory_utilization share, awake or asleep (level 1):
# CUDA context, NCCL, allocator pools (notes/colocated_scale.md).
VLLM_OUTSIDE_SHARE_GIB = 2.0
# vLLM colocated with a trainer sizes its KV cache past its share minus its weights: its profile
# counts the whole GPU's used memory, so a trainer that frees memory while vLLM starts grows vLLM's
# cache. Fitted per TP rank as these bytes x layers x hidden_size^2 to the 4B and 8B shapes
# (notes/colocated_scale.md). With `generator.sleep` the plan sizes the cache instead
# (`vllm_kv_cache_bytes`) and counts no overshoot.
VLLM_OVERSHOOT_BYTES_PER_LAYER_HIDDEN2 = 14
# Compiled layers (`trainer.compile_layers`, CUDA) save this share of the eager layer's bytes:
# the compiler recomputes the norms' fp32 copies and the activations' elementwise products instead
# of keeping them. Fitted by least squares, with the compiled LM head's chunk, to the 1.7B and 4B
# shapes' measured trainer peaks, checkpointing off (trainer_throughput_gpu.md).
COMPILED_ACTIVATION_SHARE = 0.72
# Bytes per vocabulary entry of one LM-head chunk's token at most live at once (`_TokenLogprobs`
# in rlactors.models.decoder: one chunk's logits at a time, recomputed in backward). Eager, the
# forward with the entropy holds the most: the bf16 logits and three fp32 [chunk, vocab] tensors
# (the upcast or the product, the log-probabilities, their exp); backward holds 9.
EAGER_LOGPROB_CHUNK_BYTES = 2 + 4 + 4 + 4
# Compiled (`LogSoftmax.compile_kernels`), the forward's reductions read the bf16 logits and write
# per-token results only, and backward's one elementwise pass writes their bf16 gradient beside them.
COMPILED_LOGPROB_CHUNK_BYTES = 2 + 2


def saved_bytes_per_token_layer(args: ModelArgs, dtype_bytes: int = 2, lora: LoraConfig | None = None) -> int:
    """The bytes one eager decoder layer saves for backward per token (what autograd keeps), with
    a FlashAttention-style attention that saves q, k, v, its output and an fp32 logsumexp per head.

    Each RMSNorm keeps the fp32 copy of its input, an fp32 rsqrt per row, the normalized input
    (for the weight's gradient) and its output (the next matmul's input): two norms of `hidden`,
    and in Qwen3 a q/k norm per head, whose output RoPE does not keep (it multiplies by
    constants). Attention keeps rotated q and k, v, its output and the logsumexp; the MLP keeps
    gate, silu(gate), up and their product (down's input). With `lora` (rank > 0) all but the
    adapters is frozen: no norm keeps its normalized input, a matmul's input is kept only when an
    adapted linear reads it, and each adapted linear's B keeps A's r outputs."""
    h, i = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    b = dtype_bytes
    targets = set(lora.target_modules) if lora is not None and lora.rank else None

    def read(*linears: str) -> int:  # 1 when a trainable weight needs these linears' input
        return int(targets is None or bool(targets.intersection(linears)))

    normalized = read()  # the norms' weights train
    norms = ((4 + b * normalized + b * read("q_proj", "k_proj", "v_proj")) * h + 4
             + (4 + b * normalized + b * read("gate_proj", "up_proj")) * h + 4)
    if args.family.qk_norm:  # no output kept: fp32 copy, rsqrt, normalized input
        norms += (4 + b * normalized) * (q + kv) + 4 * (heads + kv_heads)
    attention = b * (2 * q + 2 * kv) + 4 * heads
    mlp = (3 + read("down_proj")) * b * i
    adapters = b * lora.rank * len(targets) if targets else 0
    return norms + attention + mlp + adapters


@functools.cache
def _param_counts(args: ModelArgs) -> tuple[int, int, int, int]:
    """(all parameters, the root unit's, the largest decoder layer's, the root's largest tensor's)."""
    from rlactors.models.checkpoint import model_shapes

    layers = [0] * args.num_hidden_layers
    root = largest = 0
    for name, shape in model_shapes(args).items():
        n = math.prod(shape)
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += n
        else:
            root, largest = root + n, max(largest, n)
    return root + sum(layers), root, max(layers), largest


def _lora_counts(args: ModelArgs, lora: LoraConfig) -> tuple[int, int, int]:
    """(the adapters' parameters, the largest decoder layer's, the adapted linears' base
    parameters) of `lora` on the plain decoder of `args`; zeros without LoRA."""
    from rlactors.models.checkpoint import model_shapes

    if not lora.rank:
        return 0, 0, 0
    layers = [0] * args.num_hidden_layers
    base = 0
    for name, shape in model_shapes(args).items():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in lora.target_modules \
                and ".experts." not in name:
            layers[int(parts[2])] += lora.rank * (shape[0] + shape[1])  # A [r, in] and B [out, r]
            base += math.prod(shape)
    return sum(layers), max(layers), base


def frozen_forward_bytes(args: ModelArgs, dtype_bytes: int, ranks: int, tokens: int, chunk_tokens: int) -> float:
    """The working set of a no-grad forward of a frozen copy sharded over `ranks` (the reference
    policy, the teacher) on a microbatch of `tokens`, beside its weights: the gathered root unit
    and two layers (over ranks), one layer's intermediates (at most what it would save for
    backward), the final hidden states, per-token logprobs and one LM-head chunk as the eager
    head holds it (these copies are never compiled; computing no entropy, a chunk holds at most
    10 of its 14 bytes an entry)."""
    _, root, largest_layer, _ = _param_counts(args)
    copies = dtype_bytes * (root + 2 * largest_layer) if ranks > 1 else 0
    layer = tokens * saved_bytes_per_token_layer(args, dtype_bytes)
    chunk = min(chunk_tokens, tokens) * args.vocab_size * EAGER_LOGPROB_CHUNK_BYTES
    head = tokens * (dtype_bytes * args.hidden_size + 4) + chunk
    return copies + layer + head


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer GPU at the peak of a step (the last microbatch's backward)."""

    master_weights: float
    gradients: float
    optimizer: float  # AdamW's moments on the GPU (offloaded: one group's, during the step)
    compute_copies: float  # bf16 root unit and two layers, gathered
    activations: float
    logprob_head: float
    optimizer_resident: float  # AdamW's moments on the GPU between steps (0: offloaded)
    sync_buffer: float = 0.0  # the weight sync's packed policy, kept on rank 0 (`sync_memory`)
    sync_gather: float = 0.0  # the policy gathered on rank 0 while it is sent, then freed
    context: float = CUDA_CONTEXT_GIB * GIB
    frozen_base: float = 0.0  # with model.lora: the base's shard, in the compute dtype, no master
    reference: float = 0.0  # the reference policy's shard (loss.kl_coef), in model.dtype
    reference_forward: float = 0.0  # its forward's working set, before the policy's forward
    reference_logprobs: float = 0.0  # its fp32 logprobs of the microbatch, kept for the loss

    @property
    def peak(self) -> float:
        """The last microbatch's backward, or the reference's forward before it if that is larger;
        both beside the weights, gradients, moments and the reference's logprobs."""
        policy = self.compute_copies + self.activations + self.logprob_head + self.reference_logprobs
        return (self.master_weights + self.frozen_base + self.reference + self.gradients + self.optimizer
                + self.sync_buffer + self.context + max(policy, self.reference_forward))

    @property
    def resident(self) -> float:
        """What stays while the engines generate: master weights (and a frozen base), the moments
        unless offloaded, the reference, the sync's buffer (the gradients are freed by the step,
        the activations by backward, the gathered policy by the turn that wakes the KV cache)."""
        return (self.master_weights + self.frozen_base + self.reference + self.optimizer_resident + self.sync_buffer
                + self.context)


@dataclass(frozen=True)
class GeneratorMemory:
    """Bytes of one generator replica on each of its GPUs."""

    engine: str
    share: float  # what it takes awake: vLLM its gpu_memory_utilization and beyond, native its weights and cache
    weights: float
    kv_cache: float
    kv_tokens: int
    asleep: float  # what stays while it sleeps (vLLM level 1: the CUDA context)
    beyond: float = 0.0  # vLLM awake beyond its share (`vllm_beyond_share`), in `share`
    lora_base: float = 0.0  # with model.lora: its copy of the adapted linears' base (native: and adapters)


@dataclass(frozen=True)
class TeacherMemory:
    """Bytes of the teacher's proc (`teacher.path`) on its trainer host's first GPU: its shard
    (over the trainer hosts, in model.dtype) and its scoring forward's working set, which its
    allocator keeps cached in every phase."""

    weights: float
    scoring: float
    context: float = CUDA_CONTEXT_GIB * GIB

    @property
    def total(self) -> float:
        return self.weights + self.scoring + self.context


@dataclass(frozen=True)
class MemoryPlan:
    config: Config
    args: ModelArgs
    trainer: TrainerMemory
    generator: GeneratorMemory
    gpu_bytes: float | None  # one GPU's memory; None: unknown (no check)
    teacher: TeacherMemory | None = None

    @property
    def colocated(self) -> bool:
        return self.config.controller.colocate

    @property
    def sleeps(self) -> bool:
        return self.colocated and self.config.generator.sleep

    def phases(self) -> dict[str, tuple[float, float]]:
        """Per GPU, (trainer, generator) bytes in each phase that holds the GPU. Colocated with
        sleep: the trainer's step, the weight sync (vLLM's weights awake, the trainer gathering)
        and generation; colocated without: both at their peak at once; apart: the trainer's GPUs
        and the generators' GPUs. The trainer's part counts the teacher's proc beside rank 0."""
        t, g = self.trainer, self.generator
        teacher = self.teacher.total if self.teacher else 0.0
        if self.sleeps:
            return {"training": (t.peak + teacher, g.asleep),
                    "syncing": (t.resident + t.sync_gather + teacher, g.asleep + g.weights),
                    "generation": (t.resident + teacher, g.share)}
        if self.colocated:
            return {"both": (t.peak + teacher, g.share)}
        return {"trainer GPUs": (t.peak + teacher, 0.0), "generator GPUs": (0.0, g.share)}

    @property
    def needed(self) -> tuple[str, float, float]:
        """The phase that needs most, with its (trainer, generator) bytes."""
        name, (trainer, generator) = max(self.phases().items(), key=lambda kv: sum(kv[1]))
        return name, trainer, generator

    @property
    def host_bytes(self) -> float:
        """Host memory per GPU that the run moves there (not checked): AdamW's offloaded moments
        and, asleep, vLLM's weights."""
        t, g = self.trainer, self.generator
        moments = t.master_weights * 2 if self.config.trainer.offload_optimizer else 0.0
        return moments + (g.weights if self.sleeps and g.engine == "vllm" else 0.0)

    def largest_share(self, margin_gib: float = 0.0) -> float:
        """The largest `generator.gpu_memory_utilization` (to 0.01 below) whose colocated vLLM
        fits beside what the trainer holds while it generates (its resident memory with sleep,
        else its step peak), with `margin_gib` to spare; 0 when nothing is left."""
        t, g = self.trainer, self.generator
        trainer = (t.resident if self.sleeps else t.peak) + (self.teacher.total if self.teacher else 0.0)
        left = self.gpu_bytes - trainer - g.beyond - margin_gib * GIB
        return max(0.0, math.floor(100 * left / self.gpu_bytes) / 100)

    def share_holding(self, tokens: int) -> float:
        """The `generator.gpu_memory_utilization` (to 0.01 above) whose vLLM KV cache holds `tokens`
        beside its weights and runtime: the inverse of `vllm_kv_cache_bytes`."""
        g = self.config.generator
        kv = tokens * kv_bytes_per_token(self.args, DTYPES[self.config.model.dtype].itemsize) / g.tp
        return math.ceil(100 * (self.generator.weights + VLLM_RUNTIME_GIB * GIB + kv) / self.gpu_bytes) / 100

    def problems(self) -> list[str]:
        """Why the run cannot fit this GPU, each with the keys to change; empty when it fits or
        the GPU's size is unknown."""
        if self.gpu_bytes is None:
            return []
        c, g = self.config, self.generator
        who = "trainer and teacher" if self.teacher else "trainer"
        found = []
        phases = self.phases()
        share = c.generator.gpu_memory_utilization
        if sum(phases.get("generation", (0.0, 0.0))) > self.gpu_bytes:
            trainer, generator = phases.pop("generation")
            most = self.largest_share()
            found.append(f"{_gib(trainer + generator)} GiB needed per GPU of {_gib(self.gpu_bytes)} while vLLM "
                         f"generates: generator.gpu_memory_utilization = {share:g} ({_gib(generator - g.beyond)} GiB, "
                         f"{_gib(g.beyond)} beyond it) is too big beside the {who}'s {_gib(trainer)} GiB kept "
                         f"between steps: set " + (f"generator.gpu_memory_utilization <= {most:g} or " if most else "")
                         + self._fixes(resident_only=True))
        name, (trainer, generator) = max(phases.items(), key=lambda phase: sum(phase[1]))
        if trainer + generator > self.gpu_bytes:
            fixes = (f"the weight sync by {c.generator.weight_sync} gathers {_gib(self.trainer.sync_gather)} GiB on "
                     "trainer rank 0's GPU: set controller.colocate = false or raise generator.tp"
                     if name == "syncing" else "set " + self._fixes())
            found.append(f"{_gib(trainer + generator)} GiB needed per GPU of {_gib(self.gpu_bytes)} "
                         f"({self._split(name, trainer, generator)}): {fixes}")
        if g.engine == "vllm" and g.kv_tokens < c.generator.max_model_len:
            found.append(f"vLLM's share ({_gib(g.share - g.beyond)} GiB) leaves KV cache for {g.kv_tokens} tokens "
                         f"after its weights ({_gib(g.weights)} GiB), fewer than generator.max_model_len = "
                         f"{c.generator.max_model_len}: raise generator.gpu_memory_utilization or generator.tp")
        return found

    def _fixes(self, resident_only: bool = False) -> str:
        c = self.config
        keys = []
        if not c.trainer.offload_optimizer:
            keys.append("trainer.offload_optimizer = true")
        if resident_only:
            return " or ".join([*keys, "more trainer.ranks"])
        if self.colocated and c.generator.engine == "vllm" and not c.generator.sleep:
            keys.append("generator.sleep = true")
        if not c.trainer.activation_checkpointing:
            keys.append("trainer.activation_checkpointing = true")
        if self.colocated and not self.sleeps:
            keys.append("lower generator.gpu_memory_utilization")
        keys.append("more trainer.ranks")
        keys.append("lower batcher.rows_per_microbatch or batcher.row_tokens")
        return ", ".join(keys[:-1]) + " or " + keys[-1]

    def ran_out_line(self, call: str, said: str) -> str:
        """What to say when `call` (an actor call: the trainer's, or the router's for the engines)
        ran out of GPU memory with `said`, though the plan fits: the plan's phase where that side
        holds most (the engines': generation in turns, their own GPUs apart) and the keys that
        lower it."""
        phases = self.phases()
        if not call.startswith(("router.", "generator")):
            name, fixes = self.needed[0], self._fixes()
        elif self.sleeps:
            name, fixes = "generation", f"lower generator.gpu_memory_utilization or {self._fixes(resident_only=True)}"
        elif self.colocated:
            name, fixes = "both", self._fixes()
        else:
            name, fixes = "generator GPUs", "lower generator.gpu_memory_utilization or raise generator.tp"
        trainer, generator = phases[name]
        where = "" if self.gpu_bytes is None else f" of {_gib(self.gpu_bytes)}"
        return (f"{call} ran out of GPU memory ({said}); the memory plan put a GPU at {_gib(trainer + generator)} GiB"
                f"{where} ({self._split(name, trainer, generator)}), and it counts tensors, not what the allocators "
                f"keep besides: set {fixes}")

    def _split(self, name: str, trainer: float, generator: float) -> str:
        """Phase `name`'s bytes by side: "training: trainer 69.3 + vllm 2.0"."""
        who = "trainer and teacher" if self.teacher else "trainer"
        return f"{name}: {who} {_gib(trainer)} + {self.generator.engine} {_gib(generator)}"

    def check(self) -> None:
        """Raises ConfigError, one line, when the run cannot fit (`problems`)."""
        found = self.problems()
        if found:
            raise ConfigError("memory plan: " + "; ".join(found))

    def table(self) -> str:
        """The plan as a table, GiB per GPU, and its verdict."""
        c, t, g = self.config, self.trainer, self.generator
        ranks = c.trainer.ranks
        tokens = c.batcher.rows_per_microbatch * c.batcher.row_tokens
        each = f" (1/{ranks} each)" if ranks > 1 else ""
        lora = f"LoRA rank {c.model.lora.rank} adapters' " if c.model.lora.rank else ""
        rows = [
            (f"trainer: {lora}fp32 master weights{each}", t.master_weights),
            (f"trainer: {lora}fp32 gradients", t.gradients),
            ("trainer: AdamW moments on the GPU" + (" (offloaded: one group)" if c.trainer.offload_optimizer else ""),
             t.optimizer),
            ("trainer: gathered compute copies", t.compute_copies),
            (f"trainer: activations, {tokens} tokens a microbatch, checkpointing "
             f"{'on' if c.trainer.activation_checkpointing else 'off'}", t.activations),
            (f"trainer: LM head, {c.trainer.logprob_chunk_tokens}-token chunks", t.logprob_head),
            (f"trainer: weight sync ({c.generator.weight_sync}) buffer kept on rank 0", t.sync_buffer),
            (f"trainer: weight sync ({c.generator.weight_sync}) gather on rank 0, while syncing", t.sync_gather),
            ("trainer: CUDA context and workspaces", t.context),
        ]
        if c.model.lora.rank:
            rows.insert(1, (f"trainer: LoRA's frozen base, {'bf16' if c.trainer.mixed_precision else 'fp32'}{each}",
                            t.frozen_base))
        if t.reference:
            rows += [(f"trainer: reference policy (loss.kl_coef), {c.model.dtype}{each}", t.reference),
                     ("trainer: reference's forward, before the policy's", t.reference_forward),
                     ("trainer: reference's logprobs, kept for the loss", t.reference_logprobs)]
        rows += [
            ("trainer: step peak", t.peak),
            ("trainer: kept while generating", t.resident),
            (f"{g.engine}: weights" + (f" (1/{c.generator.tp} each)" if c.generator.tp > 1 else ""), g.weights),
            (f"{g.engine}: KV cache, {g.kv_tokens} tokens", g.kv_cache),
            (f"{g.engine}: awake" + (f" (gpu_memory_utilization {c.generator.gpu_memory_utilization:g})"
                                     if g.engine == "vllm" else ""), g.share),
        ]
        if g.engine == "vllm":
            rows.append(("vllm: of which beyond its share (context, pools"
                         + ("" if c.generator.sleep else ", its profile's overshoot")
                         + (", LoRA's base copy)" if g.lora_base else ")"), g.beyond))
        if g.lora_base:
            rows.append((f"{g.engine}: of which its copy of the adapted linears' base, to merge LoRA from"
                         + (", and the adapters" if g.engine == "native" else ""), g.lora_base))
        if self.sleeps:
            rows.append((f"{g.engine}: asleep", g.asleep))
        if self.teacher:
            hosts = c.job.trainer_hosts
            rows += [(f"teacher: weights, {c.model.dtype}" + (f" (1/{hosts} each)" if hosts > 1 else ""),
                      self.teacher.weights),
                     ("teacher: scoring forward, kept cached", self.teacher.scoring),
                     ("teacher: CUDA context", self.teacher.context),
                     ("teacher: on trainer rank 0's GPU, in every phase", self.teacher.total)]
        for name, (trainer, generator) in self.phases().items():
            rows.append((f"GPU in phase '{name}' (trainer{', teacher' if self.teacher else ''} + generator)",
                         trainer + generator))
        if self.host_bytes:
            rows.append(("host memory per GPU (offloaded moments, sleeping weights)", self.host_bytes))
        width = max(len(name) for name, _ in rows)
        lines = [f"{'memory plan, GiB per GPU':<{width}}  {'GiB':>7}", f"{'-' * width}  {'-' * 7}"]
        lines += [f"{name:<{width}}  {_gib(value):>7}" for name, value in rows]
        if self.gpu_bytes is None:
            lines.append("GPU size unknown: set controller.gpu_memory_gib (or plan on a machine with the GPU) to check")
        else:
            found = self.problems()
            name, trainer, generator = self.needed
            spare = (f"fits, {_gib(self.gpu_bytes - trainer - generator)} GiB spare in phase '{name}' (the plan "
                     "counts tensors, not what the allocators keep besides: keep some spare)")
            verdict = spare if not found else "does NOT fit: " + "; ".join(found)
            lines.append(f"GPU of {_gib(self.gpu_bytes)} GiB: {verdict}")
        return "\n".join(lines)


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def gpu_gib(config: Config) -> float | None:
    """One GPU's memory: `controller.gpu_memory_gib` when set, else that of the first GPU this
    process sees (CUDA_VISIBLE_DEVICES) as nvidia-smi reports it, else unknown (None). Asked of
    nvidia-smi, not CUDA, so that the controller's process holds no CUDA context on the GPU."""
    if config.controller.gpu_memory_gib > 0:
        return config.controller.gpu_memory_gib
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                               "-i", visible], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return float(done.stdout.split()[0]) / 1024  # MiB


def gpu_processes(gpu: str | None = None) -> dict[int, tuple[int, str]]:
    """Who holds memory on `gpu` (an nvidia-smi index; None: every GPU, summed per process), as
    nvidia-smi lists them: pid -> (MiB, the start of its command line, "?" where this process
    cannot read it); empty where nvidia-smi lists none or is missing."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
                                 *(["-i", gpu] if gpu is not None else [])],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[int, tuple[int, str]] = {}
    for line in listed.splitlines():
        try:
            pid, mib = (int(part.strip()) for part in line.split(","))
        except ValueError:  # "[N/A]" where the driver does not tell
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120].strip() or "?"
        except OSError:
            command = "?"
        found[pid] = (found.get(pid, (0, ""))[0] + mib, command)
    return found


def plan(config: Config, args: ModelArgs, gpu_gib: float | None = None) -> MemoryPlan:
    """The plan of `config` for the model `args` (the checkpoint's config.json) on GPUs of
    `gpu_gib` GiB (None: unknown, nothing is checked); with `teacher.path`, that checkpoint's
    config.json gives the teacher's shape."""
    gpu_bytes = None if gpu_gib is None else gpu_gib * GIB
    return MemoryPlan(config, args, trainer_memory(config, args), generator_memory(config, args, gpu_bytes), gpu_bytes,
                      teacher_memory(config) if config.teacher.path else None)


def teacher_memory(config: Config) -> TeacherMemory:
    """The teacher's proc: one a trainer host, its ranks sharding it (rlactors.actors.teacher),
    scoring one microbatch at a time."""
    from rlactors.models.checkpoint import load_args
    from rlactors.trainer.reference import reference_bytes_per_rank

    args, dtype, hosts = load_args(config.teacher.path), DTYPES[config.model.dtype], config.job.trainer_hosts
    tokens = config.batcher.rows_per_microbatch * config.batcher.row_tokens
    return TeacherMemory(reference_bytes_per_rank(args, dtype, hosts),
                         frozen_forward_bytes(args, dtype.itemsize, hosts, tokens, config.trainer.logprob_chunk_tokens))


def trainer_compiles(config: Config) -> bool:
    """Whether the trainer compiles its decoder layers and its LM head's kernels: with
    `trainer.compile_layers` on CUDA, outside true on-policy mode, whose kernels run eager
    (`PolicyTrainerCore`)."""
    return config.trainer.compile_layers and config.controller.device == "cuda" and not config.model.true_on_policy


def trainer_memory(config: Config, args: ModelArgs) -> TrainerMemory:
    """One trainer rank's bytes. With `model.lora` only the adapters have fp32 masters, gradients
    and moments; the base is frozen in the compute dtype (rlactors.lora.adapters.to_lora)."""
    t, b = config.trainer, config.batcher
    ranks = t.ranks
    params, root, layer, largest_root = _param_counts(args)
    lora = config.model.lora
    adapters, adapters_layer, _ = _lora_counts(args, lora)
    mixed = t.mixed_precision  # on CUDA: bf16 compute over fp32 masters
    compute_bytes = 2 if mixed else 4
    trained = adapters or params
    # An offload group is a decoder layer or one tensor of the root unit (rlactors.trainer.offload).
    moments = 8 * trained / ranks
    largest_group = adapters_layer if adapters else max(largest_root, layer)
    on_gpu = 8 * largest_group / ranks if t.offload_optimizer else moments
    copies = compute_bytes * (root + 2 * (layer + adapters_layer)) if (mixed or ranks > 1) else 0.0
    tokens = b.rows_per_microbatch * b.row_tokens
    per_layer = saved_bytes_per_token_layer(args, compute_bytes, lora)
    compiles = trainer_compiles(config)
    if compiles:
        per_layer *= COMPILED_ACTIVATION_SHARE
    layers = args.num_hidden_layers
    if t.activation_checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        activations = tokens * (layers * compute_bytes * args.hidden_size + per_layer)
    else:
        activations = tokens * layers * per_layer
    chunk = min(t.logprob_chunk_tokens, tokens)
    # The final hidden states (kept for backward), per token fp32 logprob, logsumexp and entropy,
    # and one chunk's logits at a time.
    chunk_bytes = COMPILED_LOGPROB_CHUNK_BYTES if compiles else EAGER_LOGPROB_CHUNK_BYTES
    head = tokens * (compute_bytes * args.hidden_size + 12) + chunk * args.vocab_size * chunk_bytes
    sync_buffer, sync_gather = sync_memory(config, args)
    reference = {}
    if config.loss.kl_coef > 0:
        from rlactors.trainer.reference import reference_bytes_per_rank

        dtype = DTYPES[config.model.dtype]
        reference = dict(reference=reference_bytes_per_rank(args, dtype, ranks, t.expert_parallel),
                         reference_forward=frozen_forward_bytes(args, dtype.itemsize, ranks, tokens,
                                                                t.logprob_chunk_tokens),
                         reference_logprobs=4 * tokens)
    return TrainerMemory(master_weights=4 * trained / ranks, gradients=4 * trained / ranks, optimizer=on_gpu,
                         compute_copies=copies, activations=activations, logprob_head=head,
                         optimizer_resident=0.0 if t.offload_optimizer else moments, sync_buffer=sync_buffer,
                         sync_gather=sync_gather, frozen_base=compute_bytes * params / ranks if adapters else 0.0,
                         **reference)


def sync_memory(config: Config, args: ModelArgs) -> tuple[float, float]:
    """The weight sync's bytes on trainer rank 0: (kept, gathered while syncing), of what it sends
    (the policy, or with `model.lora` the adapters) in `model.dtype`. "broadcast" and "shared"
    keep it packed in one buffer (the replicas receive it or map it by CUDA IPC). "messages"
    gathers it to host memory a chunk of rows at a time (`PolicyTrainerCore.full_weights`): a
    staging chunk and, over ranks, every rank's slot of it."""
    from rlactors.trainer.gather import GATHER_CHUNK_BYTES

    synced = _lora_counts(args, config.model.lora)[0] or _param_counts(args)[0]
    policy, ranks = DTYPES[config.model.dtype].itemsize * synced, config.trainer.ranks
    if config.generator.weight_sync in ("broadcast", "shared"):
        return policy, 0.0
    return 0.0, min(policy, GATHER_CHUNK_BYTES) * (2 + 1 / ranks if ranks > 1 else 1)


def kv_bytes_per_token(args: ModelArgs, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    return 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype_bytes


def generator_memory(config: Config, args: ModelArgs, gpu_bytes: float | None) -> GeneratorMemory:
    """vLLM takes gpu_memory_utilization of a GPU of `gpu_bytes` (unknown: its weights and
    runtime, with no KV cache, the least it needs); the native engine its weights and its
    `generator.kv_cache_tokens`."""
    g, m = config.generator, config.model
    dtype_bytes = DTYPES[m.dtype].itemsize
    weights = _replica_weights(args, dtype_bytes, g.tp)
    per_token = kv_bytes_per_token(args, dtype_bytes) / g.tp
    adapters, _, adapted = _lora_counts(args, m.lora)
    if g.engine == "native":  # with LoRA, each adapted linear's base copy and its adapters
        kv = g.kv_cache_tokens * per_token
        lora = dtype_bytes * (adapted + adapters) / g.tp
        held = weights + kv + lora + CUDA_CONTEXT_GIB * GIB
        return GeneratorMemory("native", held, weights, kv, g.kv_cache_tokens, asleep=held, lora_base=lora)
    share = g.gpu_memory_utilization * gpu_bytes if gpu_bytes is not None else weights + VLLM_RUNTIME_GIB * GIB
    kv = max(0.0, share - weights - VLLM_RUNTIME_GIB * GIB)
    # With LoRA the replica's copy of the adapted rows is made outside vLLM's pools: it stays asleep.
    lora = dtype_bytes * adapted / g.tp
    beyond = vllm_beyond_share(args, g.tp, planned_kv_cache=g.sleep) + lora
    return GeneratorMemory("vllm", share + beyond, weights, kv, int(kv // per_token),
                           asleep=VLLM_OUTSIDE_SHARE_GIB * GIB + lora, beyond=beyond, lora_base=lora)


def _replica_weights(args: ModelArgs, dtype_bytes: int, tp: int) -> float:
    """A replica's weights on each of its GPUs."""
    return dtype_bytes * _param_counts(args)[0] / tp


def vllm_kv_cache_bytes(config: Config, args: ModelArgs, gpu_bytes: float) -> int:
    """The KV cache each GPU of a vLLM replica allocates when the plan sizes it (`generator.sleep`:
    replicas colocated in turns): its gpu_memory_utilization share of a GPU of `gpu_bytes` less its
    weights and runtime. vLLM's own sizing profiles the GPU's used memory while it starts, and a
    colocated trainer changing its memory meanwhile moves that size by gigabytes."""
    g = config.generator
    weights = _replica_weights(args, DTYPES[config.model.dtype].itemsize, g.tp)
    return int(max(0.0, g.gpu_memory_utilization * gpu_bytes - weights - VLLM_RUNTIME_GIB * GIB))


def vllm_beyond_share(args: ModelArgs, tp: int, planned_kv_cache: bool = False) -> float:
    """What an awake vLLM replica holds on each GPU beyond its gpu_memory_utilization share: its
    process's context and pools, and unless the plan sizes its KV cache (`planned_kv_cache`),
    the cache its profile sizes past the share."""
    overshoot = 0.0 if planned_kv_cache else \
        VLLM_OVERSHOOT_BYTES_PER_LAYER_HIDDEN2 * args.num_hidden_layers * args.hidden_size**2 / tp
    return VLLM_OUTSIDE_SHARE_GIB * GIB + overshoot


def out_of_memory(error: BaseException) -> tuple[str, str] | None:
    """`(call, said)` when `error`, a failed actor call (Monarch's ActorError, maybe around another
    actor's), failed for want of GPU memory: torch's OutOfMemoryError, or a CUDA allocation of
    vLLM's sleep-mode allocator. `call` is the call the controller made, `said` the error's first
    sentences (what was asked and what was free); None for any other failure."""
    import torch

    call = re.match(r"Actor call (\S+) failed", getattr(error, "message", ""))
    cause = error
    while hasattr(cause, "exception"):
        cause = cause.exception
    text = str(cause)
    if not (isinstance(cause, torch.OutOfMemoryError) or "CUDA Error: out of memory" in text):
        return None
    said = ". ".join(text.splitlines()[0].split(". ")[:3]).rstrip(".")
    return (call.group(1) if call else "an actor call"), said
