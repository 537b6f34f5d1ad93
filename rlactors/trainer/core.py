"""PolicyTrainerCore: one data-parallel rank of the policy trainer (FSDP2), without Monarch.

Every rank of the trainer mesh runs one core and receives the same calls in the same order; the
Monarch actor (rlactors.actors.trainer) is a thin shell that forwards them. The controller drives
a step as forward_backward x k (gradient accumulation), then optim_step.

Calls that take microbatches receive every rank's microbatch (`microbatches[r]` is rank r's) and
check all of them before any collective, so bad input fails on every rank alike, before anything
changes: no rank is left waiting in a collective, and gradients, optimizer and version are intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlactors.attention.varlen import cu_seqlens_from_positions
from rlactors.config import LossConfig, ModelConfig, TeacherConfig, TrainerConfig, check_model_keys
from rlactors.lora import adapters as lora
from rlactors.lora.peft_io import save_peft_adapter
from rlactors.models.args import DTYPES
from rlactors.models.checkpoint import (
    checkpoint_shapes,
    copy_tokenizer_files,
    load_args,
    save_pretrained,
)
from rlactors.models.moe import SparseMoeBlock, load_balancing_loss
from rlactors.on_policy.sides import TrainerSide
from rlactors.storage.records import writing
from rlactors.trainer import checkpoint as ckpt
from rlactors.trainer import expert_parallel
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.gather import GATHER_CHUNK_BYTES, RowGather, plan_chunked, plan_packing, row_chunks
from rlactors.trainer.losses import LossNorm, LossStats, compute_loss, distillation_advantages, loss_tokens
from rlactors.trainer.offload import OffloadedStep, layer_groups
from rlactors.trainer.parallel import build_sharded_model, clip_grad_norm_, make_mesh
from rlactors.trainer.reference import ReferencePolicy, load_sharded_weights
from rlactors.weight_sync.broadcast import WeightSender
from rlactors.weight_sync.checksum import state_checksum
from rlactors.weight_sync.packed import Chunk, PackedLayout
from rlactors.weight_sync.shared import SharedBuffer

# With model.lora, LORA_DIR in a checkpoint holds the adapters as a PEFT adapter.
LORA_DIR = "lora_adapter"

MICROBATCH_FIELDS = ("input_ids", "positions", "target_ids", "loss_mask", "advantages",
                     "generator_logprobs", "versions")


@dataclass
class VersionedWeights:
    """Full (unsharded) policy weights under HF names, the policy version they are, and their
    checksum, which every replica verifies against what it received."""

    version: int
    weights: dict[str, torch.Tensor]
    checksum: str


def validate_microbatch(mb: MicroBatch, vocab_size: int, where: str = "microbatch") -> None:
    """Raises ValueError naming what is wrong with `mb`."""
    for name in MICROBATCH_FIELDS:
        if not isinstance(getattr(mb, name, None), torch.Tensor):
            raise ValueError(f"{where}.{name} is missing or not a tensor")
    shape = mb.input_ids.shape
    if len(shape) != 2:
        raise ValueError(f"{where}.input_ids must be 2-D [rows, row_tokens], got shape {tuple(shape)}")
    if mb.input_ids.numel() == 0:
        raise ValueError(f"{where} is empty (shape {tuple(shape)})")
    for name in MICROBATCH_FIELDS:
        if getattr(mb, name).shape != shape:
            raise ValueError(f"{where}.{name} has shape {tuple(getattr(mb, name).shape)}, "
                             f"input_ids has {tuple(shape)}")
    for name in ("input_ids", "target_ids", "positions"):
        if getattr(mb, name).is_floating_point():
            raise ValueError(f"{where}.{name} must hold integers, got {getattr(mb, name).dtype}")
    for name in ("input_ids", "target_ids"):
        ids = getattr(mb, name)
        outside = (ids < 0) | (ids >= vocab_size)
        if outside.any():
            raise ValueError(f"{where}.{name} holds token id {int(ids[outside][0])} outside the "
                             f"vocabulary [0, {vocab_size})")
    for r, row in enumerate(mb.positions):
        try:
            cu_seqlens_from_positions(row)
        except ValueError as e:
            raise ValueError(f"{where}.positions row {r}: {e}") from None
    mask = mb.loss_mask.bool()
    if not torch.isfinite(mb.advantages[mask]).all():
        raise ValueError(f"{where}.advantages is not finite on a loss token")


def lr_at(config: TrainerConfig, step: int) -> float:
    """Linear warmup over `warmup_steps` optimizer steps, then constant."""
    return config.lr * min(1.0, (step + 1) / (config.warmup_steps + 1))


class PolicyTrainerCore:
    """One rank: the sharded policy, its AdamW, the policy version and the step's loss stats.

    Needs the default process group (see `parallel.init_distributed`) of `trainer.ranks` ranks.
    The fp32 master weights are loaded from `model.path` (an HF checkpoint dir). `kernels` is
    what the trainer runs (`rlactors.on_policy.sides`: the generator's kernels in
    `model.true_on_policy` mode). Decoder layers are torch.compile'd with
    `trainer.compile_layers` on CUDA unless those kernels must run eager. With `reference`, the
    rank also holds the initial weights frozen (`rlactors.trainer.reference`), for `loss.kl_coef`;
    with a `teacher` whose path is set, each microbatch's `teacher_logprobs` (scored by the teacher
    mesh, rlactors.trainer.teacher) shape the advantages (on-policy distillation).
    """

    def __init__(self, model: ModelConfig, trainer: TrainerConfig, device: torch.device, kernels: TrainerSide,
                 reference: bool = False, teacher: TeacherConfig | None = None):
        self.model_config, self.config, self.device = model, trainer, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size != trainer.ranks:
            raise ValueError(f"trainer.ranks is {trainer.ranks} but the process group has {self.world_size} ranks")
        self.args = load_args(model.path)
        check_model_keys(model, trainer, self.args)
        self.mesh = make_mesh(device)
        mixed_precision = trainer.mixed_precision and device.type == "cuda"
        self.model = build_sharded_model(
            self.args, self.mesh, device,
            mixed_precision=mixed_precision,
            activation_checkpointing=trainer.activation_checkpointing,
            compile_layers=trainer.compile_layers and device.type == "cuda" and not kernels.eager,
            convert=self._with_lora(kernels.convert, torch.bfloat16 if mixed_precision else torch.float32),
            expert_mesh=(expert_parallel.expert_mesh(device.type, trainer.expert_parallel)
                         if trainer.expert_parallel > 1 else None),
        )
        self._attention = kernels.attention
        # What checkpoints hold: with model.lora the frozen base is model.path's and stays out;
        # the adapters (and their optimizer state) go in.
        self._checkpointed = StateDictOptions(ignore_frozen_params=True, strict=not model.lora.rank)
        self._load_hf_weights(model.path)
        self.reference = ReferencePolicy(
            self.args, model.path, device, DTYPES[model.dtype], kernels, trainer.expert_parallel,
            trainer.logprob_chunk_tokens) if reference else None
        self.teacher = teacher if teacher is not None and teacher.path else None
        # Per sparse layer, of the current forward: the expert ids [T, k] its router chose (before
        # any replay), and (for the load-balancing loss) its router logits.
        self._routing: list[torch.Tensor] = []
        self._router_logits: list[torch.Tensor] = []
        self._sparse_blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        for module in self._sparse_blocks:
            module.replay.register_forward_hook(lambda _, inputs, out: self._routing.append(inputs[2]))
            if trainer.router_aux_loss_coef > 0:
                module.gate.register_forward_hook(lambda _, inputs, logits: self._router_logits.append(logits))
        self._set_optimizer()
        self.version = 0
        # The version the last optim_step aimed at (one more than the version before it, reached
        # or not), or the version loaded since: never below `version`. And the sends waiting for a
        # step to end (each an event it sets).
        self._tried_version = 0
        self._step_waiters: list[asyncio.Event] = []
        self._stats = LossStats()
        self._accumulated = 0  # forward_backward calls since the last optim_step
        self.sender: WeightSender | None = None  # rank 0, once weights go by broadcast
        self._sync_layout: PackedLayout | None = None  # the send buffer's, once a weight group formed
        self._chunk_gathers: dict[int, RowGather] = {}  # by chunk start: how each chunk of it is packed
        self.shared: SharedBuffer | None = None  # rank 0, once weights go through a shared buffer
        self._shared_gathers: dict[int, RowGather] | None = None  # how each chunk of it is packed

    def _with_lora(self, convert: Callable | None, base_dtype: torch.dtype) -> Callable | None:
        """`convert`, then with `model.lora` the LoRA conversion (frozen base in `base_dtype`)."""
        config = self.model_config.lora
        if not config.rank:
            return convert

        def convert_with_lora(model: torch.nn.Module) -> None:
            if convert is not None:
                convert(model)
            lora.to_lora(model, config, base_dtype)
        return convert_with_lora

    # ------------------------------------------------------------------------------------------
    # Training

    def forward_backward(self, microbatches: Sequence[MicroBatch], norm: LossNorm, loss: LossConfig) -> dict[str, int]:
        """Adds this rank's microbatch's gradient of its share of the step loss.

        Returns this rank's loss-token count; the loss stats come reduced from optim_step, so the
        host never waits for the device between microbatches.
        """
        self._check_microbatches(microbatches)
        tokens = [int(loss_tokens(loss.name, mb.loss_mask, mb.generator_logprobs).sum()) for mb in microbatches]
        self._check_norm(norm, loss, sum(tokens))
        if loss.kl_coef > 0 and self.reference is None:
            raise ValueError("loss.kl_coef > 0 needs the reference policy: this trainer was built without one")
        mb = microbatches[self.rank].to(self.device)
        reference = self.reference.logprobs(mb) if loss.kl_coef > 0 else None
        self._router_logits.clear()
        self._routing.clear()
        logprobs, entropy = self._token_logprobs(mb, with_entropy=True)
        advantages, generator_logprobs = mb.advantages.reshape(-1), mb.generator_logprobs.reshape(-1)
        distilled = LossStats()
        if self.teacher is not None:
            advantages, distilled = distillation_advantages(
                self.teacher.task_coef, self.teacher.coef, advantages, logprobs.detach(),
                mb.teacher_logprobs.reshape(-1), loss_tokens(loss.name, mb.loss_mask.reshape(-1), generator_logprobs))
        value, stats = compute_loss(
            loss, norm, logprobs, mb.loss_mask.reshape(-1), advantages, generator_logprobs, entropy.detach(),
            current_policy=mb.versions.reshape(-1) == self.version, positions=mb.positions.reshape(-1),
            reference_logprobs=reference,
        )
        stats = stats.merge(distilled)
        if self._router_logits:
            # Weighted by the microbatch's share of the step's loss tokens: over the step, the
            # token-weighted mean of the microbatches' load-balancing losses.
            share = tokens[self.rank] / max(norm.num_tokens, 1)
            aux = load_balancing_loss(self._router_logits, self.args.moe.num_experts_per_tok) * share
            value = value + self.config.router_aux_loss_coef * aux
            stats = stats.merge(LossStats(sums={"router_aux_loss": aux.detach().double()}))
            self._router_logits.clear()
        if self.args.moe is not None:
            stats = stats.merge(self._routing_stats(mb))
        expert_parallel.backward(self.model, value)
        self._stats = self._stats.merge(stats)
        self._accumulated += 1
        return {"loss_tokens": tokens[self.rank]}

    def optim_step(self) -> dict[str, float]:
        """Clips, steps AdamW at the scheduled LR, zeroes gradients, bumps the policy version.

        A non-finite gradient norm skips the update (`update_skipped` = 1, version unchanged).
        Also returns the step's loss stats reduced over all ranks and microbatches.
        """
        target = self.version + 1
        try:
            return self._optim_step()
        finally:
            self._tried_version = target
            for waiter in self._step_waiters:
                waiter.set()
            self._step_waiters.clear()

    def _optim_step(self) -> dict[str, float]:
        if self._accumulated == 0:
            raise ValueError("optim_step called with no gradients: call forward_backward first")
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.config.max_grad_norm)
        lr = lr_at(self.config, self.version)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self._offload is not None:
                self._offload.step()
            else:
                self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._reduced_stats()
        self._stats, self._accumulated = LossStats(), 0
        return {**metrics, "grad_norm": float(grad_norm), "lr": lr, "policy_version": self.version,
                "update_skipped": float(not finite)}

    @torch.no_grad()
    def compute_logprobs(self, microbatches: Sequence[MicroBatch]) -> torch.Tensor:
        """fp32 logprobs of this rank's microbatch's targets, shaped like it, on CPU."""
        self._check_microbatches(microbatches)
        mb = microbatches[self.rank].to(self.device)
        logprobs, _ = self._token_logprobs(mb, with_entropy=False)
        self.model.reshard()  # the root FSDP unit keeps its parameters gathered after forward
        return logprobs.reshape(mb.input_ids.shape).cpu()

    def _token_logprobs(self, mb: MicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        replayed = mb.routed_experts if self.model_config.routing_replay else None
        # Left set after the forward, so that activation checkpointing's recompute routes alike.
        for i, block in enumerate(self._sparse_blocks):
            block.replay.experts = None if replayed is None else replayed.flatten(0, 1)[:, i]
        positions = mb.positions.reshape(-1)
        hidden = self.model(mb.input_ids.reshape(-1), positions, self._attention(positions))
        targets, chunk = mb.target_ids.reshape(-1), self.config.logprob_chunk_tokens
        if with_entropy:
            return self.model.token_logprobs_and_entropy(hidden, targets, chunk)
        return self.model.token_logprobs(hidden, targets, chunk), None

    def _routing_stats(self, mb: MicroBatch) -> LossStats:
        """Over the loss tokens of the current policy whose generator returned the experts it
        routed them to: their count, and how many this forward's routers chose another set of
        experts for in any sparse layer (before any routing replay; both 0 when the generator
        returned none)."""
        routed = differ = torch.zeros((), dtype=torch.float64, device=self.device)
        if mb.routed_experts is not None:
            generator = mb.routed_experts.flatten(0, 1).sort(-1).values
            current = mb.versions.reshape(-1) == self.version
            known = (generator >= 0).all(-1).all(-1) & mb.loss_mask.reshape(-1) & current
            ours = torch.stack(self._routing, dim=1).sort(-1).values
            differs = (ours != generator).any(-1).any(-1) & known
            routed, differ = known.sum().double(), differs.sum().double()
        self._routing.clear()
        return LossStats(sums={"routed_tokens": routed, "expert_mismatch": differ})

    def _check_microbatches(self, microbatches: Sequence[MicroBatch]) -> None:
        if not isinstance(microbatches, Sequence) or len(microbatches) != self.world_size:
            got = len(microbatches) if isinstance(microbatches, Sequence) else type(microbatches).__name__
            raise ValueError(f"expected one microbatch per trainer rank ({self.world_size}), got {got}")
        moe = self.args.moe
        sparse_layers = sum(map(self.args.is_sparse_layer, range(self.args.num_hidden_layers)))
        for r, mb in enumerate(microbatches):
            validate_microbatch(mb, self.args.vocab_size, where=f"microbatches[{r}]")
            routed = getattr(mb, "routed_experts", None)
            if routed is not None and (moe is None or routed.dtype != torch.long or routed.shape !=
                                       (*mb.input_ids.shape, sparse_layers, moe.num_experts_per_tok)):
                want = "none: the model has no experts" if moe is None else \
                    f"int64 {(*mb.input_ids.shape, sparse_layers, moe.num_experts_per_tok)}"
                raise ValueError(f"microbatches[{r}].routed_experts is {routed.dtype} {tuple(routed.shape)}, "
                                 f"expected {want}")
            scored = getattr(mb, "teacher_logprobs", None)
            if self.teacher is not None and (scored is None or scored.dtype != torch.float32
                                             or scored.shape != mb.input_ids.shape):
                got = "none" if scored is None else f"{scored.dtype} {tuple(scored.shape)}"
                raise ValueError(f"microbatches[{r}].teacher_logprobs is {got}, expected float32 "
                                 f"{tuple(mb.input_ids.shape)}: teacher.path is set, the teacher mesh scores them")

    def _check_norm(self, norm: LossNorm, loss: LossConfig, here: int) -> None:
        """`here`: the loss tokens of this call's microbatches, all ranks."""
        if not isinstance(norm, LossNorm):
            raise ValueError(f"norm must be a LossNorm, got {type(norm).__name__}")
        norm.denominator(loss.name)  # raises when the counts cannot normalise this loss
        if loss.name != "dr_grpo" and here > norm.num_tokens:
            raise ValueError(f"LossNorm.num_tokens is {norm.num_tokens}, but this call alone has {here} "
                             "loss tokens: the norm must count the whole step")

    def _reduced_stats(self) -> dict[str, float]:
        """The step's stats summed (maxima: max-ed; histograms: summed) over ranks; every rank has
        the same keys."""
        stats = self._stats
        sum_keys, max_keys = sorted(stats.sums), sorted(stats.maxes)
        if sum_keys:
            sums = torch.stack([stats.sums[k] for k in sum_keys]).to(self.device)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            stats = LossStats(dict(zip(sum_keys, sums)), stats.maxes, stats.hists)
        if max_keys:
            maxes = torch.stack([stats.maxes[k] for k in max_keys]).to(self.device)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            stats = LossStats(stats.sums, dict(zip(max_keys, maxes)), stats.hists)
        for hist in stats.hists.values():
            dist.all_reduce(hist, op=dist.ReduceOp.SUM)
        return stats.metrics()

    def _set_optimizer(self) -> None:
        """A new AdamW (no state); with `trainer.offload_optimizer`, stepped a layer at a time with
        its state in host memory between steps (rlactors.trainer.offload)."""
        c = self.config
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with model.lora: the adapters
        self.optimizer = torch.optim.AdamW(trainable, lr=lr_at(c, 0), betas=tuple(c.betas),
                                           weight_decay=c.weight_decay, fused=self.device.type == "cuda")
        self._offload = (OffloadedStep(self.optimizer, layer_groups(self.model), self.device)
                         if c.offload_optimizer else None)

    def release_memory(self) -> dict[str, float]:
        """Gives the GPU memory this rank's allocator caches but no tensor uses back to the device,
        for the engines that wake on it; returns the peaks this rank allocated and its allocator
        reserved since the last call (`peak_allocated_gib`, `peak_reserved_gib`: the gap is the
        allocator's slack, which the GPU holds too) and what its allocator still holds after
        (`held_gib`); all 0 on CPU."""
        if self.device.type != "cuda":
            return {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0, "held_gib": 0.0}
        peaks = {"peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                 "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30}
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.empty_cache()
        return {**peaks, "held_gib": torch.cuda.memory_reserved(self.device) / 2**30}

    # ------------------------------------------------------------------------------------------
    # Weights: HF load, checkpoints, sync

    def _load_hf_weights(self, path: str | Path) -> None:
        """Each rank reads only its own rows of every parameter from the HF safetensors files,
        into its fp32 shard: no rank ever holds the whole model (a 32B one is 128 GB in fp32).
        With `model.lora`, the adapters start at `lora.initial_adapters`."""
        adapters = lora.initial_adapters(self.model, self.model_config.lora) if self.model_config.lora.rank else {}
        load_sharded_weights(self.model, path, adapters)

    def _synced_parameters(self) -> dict[str, torch.nn.Parameter]:
        """What the generators receive: every parameter, or with `model.lora` the adapters alone
        (the generators hold the frozen base)."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def full_weights(self, dtype: torch.dtype, synced_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every parameter (`synced_only`: those the generators receive) gathered from its shards,
        in `dtype`, on CPU: on rank 0; None elsewhere.

        A collective: every rank must call it. Tied embeddings give one tensor (no lm_head.weight),
        the HF checkpoint's names and set. Gathered in chunks of rows of about GATHER_CHUNK_BYTES,
        each through one staging buffer on the device into host memory: the GPU holds one chunk's
        buffers, not the policy.
        """
        params = self._synced_parameters() if synced_only else dict(self.model.named_parameters())
        chunks = row_chunks(params, dtype.itemsize, GATHER_CHUNK_BYTES)
        views, weights = [], None
        if self.rank == 0:
            weights = {name: torch.empty(p.shape, dtype=dtype) for name, p in params.items()}
            elements = [[rows * math.prod(params[name].shape[1:]) for name, _, rows in parts] for parts in chunks]
            staging = torch.empty(max(sum(sizes) for sizes in elements), dtype=dtype, device=self.device)
            for parts, sizes in zip(chunks, elements):
                offsets = [0, *itertools.accumulate(sizes)]
                views.append([staging[offsets[i]:offsets[i + 1]].view(rows, *params[name].shape[1:])
                              for i, (name, _, rows) in enumerate(parts)])
        gathers = plan_chunked(params, chunks, dtype, [lambda i, v=v: v[i] for v in views] or None, self.device)
        for parts, gather, staged in itertools.zip_longest(chunks, gathers, views):
            gather.run()
            for (name, first, rows), view in zip(parts, staged or []):
                weights[name][first:first + rows].copy_(view)
        return weights

    def state_dict_for_sync(self, dtype: str | None = None) -> VersionedWeights | None:
        """The policy for the generators (default dtype: `model.dtype`), with its version; rank 0 only."""
        dtype_name = dtype or self.model_config.dtype
        if dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype_name!r}")
        weights = self.full_weights(DTYPES[dtype_name], synced_only=True)
        return None if weights is None else VersionedWeights(self.version, weights, state_checksum(weights))

    # ------------------------------------------------------------------------------------------
    # Weight sync by broadcast (rlactors.weight_sync.broadcast): rank 0 sends one packed buffer

    def weight_layout(self, dtype: str | None = None) -> PackedLayout:
        """The packed layout of the policy in the generator dtype (from global shapes, no gather)."""
        torch_dtype = DTYPES[dtype or self.model_config.dtype]
        return PackedLayout.of((name, torch.empty(p.shape, dtype=torch_dtype, device="meta"))
                               for name, p in self._synced_parameters().items())

    def init_weight_sender(self, host: str, port: int, world_size: int, layout: PackedLayout) -> None:
        """Rank 0 forms the weight group as its rank 0 (blocks until every replica joins), in
        place of any earlier group; every rank records `layout` (`weight_layout`, perhaps in
        other chunks), which it gathers the weights in and rank 0 sends in."""
        dtypes = {spec.dtype for spec in layout.specs}
        shapes = {spec.name: spec.shape for spec in layout.specs}
        if len(dtypes) != 1 or shapes != {name: tuple(p.shape) for name, p in self._synced_parameters().items()}:
            raise ValueError(f"the weight layout is not this policy's in one dtype: {sorted(dtypes)}, "
                             f"{sorted(shapes)[:3]}...")
        if layout != self._sync_layout:
            self._sync_layout = layout
            if self.rank == 0:
                # On several ranks each chunk's packing is a gather over them: not in the sender's graph.
                self.sender = WeightSender(layout, self.device, self._pack_chunk, capture=self.world_size == 1)
            self._chunk_gathers = plan_packing(self._synced_parameters(), layout, DTYPES[dtypes.pop()],
                                               self.sender.buffer if self.rank == 0 else None, self.device)
        if self.rank == 0:
            self.sender.join(host, port, world_size)

    async def send_weights(self, version: int) -> dict[str, Any] | None:
        """Gathers the policy into rank 0's send buffer chunk by chunk (a collective: all ranks
        call it), while rank 0 broadcasts each chunk once packed (called together with the
        replicas' receive). The send waits until this rank's policy is `version` or an
        optim_step has tried to make it: so it may be called with the optimizer step that makes
        `version`, and starts as that step ends, with no call in between. A step that did not
        make it sends the policy it left, which the replicas reject as another version. Rank 0
        returns the version, the checksum the replicas verified, and timings (`WeightSender.send`,
        and `step_wait_s`: how long the send waited for the step)."""
        waiting = time.perf_counter()
        while self._tried_version < version:
            self._step_waiters.append(stepped := asyncio.Event())
            await stepped.wait()
        step_wait_s = time.perf_counter() - waiting
        if self.rank != 0:
            for chunk in self._sync_layout.chunks:
                self._pack_chunk(chunk, None)
            return None
        return {**await self.sender.send(self.version), "step_wait_s": step_wait_s}

    def _pack_chunk(self, chunk: Chunk, _: torch.Tensor | None) -> None:
        """The rows of `chunk`'s pieces into rank 0's send buffer (a collective on several ranks)."""
        self._chunk_gathers[chunk.start].run()

    def share_weights(self, dtype: str | None = None) -> dict[str, Any] | None:
        """Packs the policy into rank 0's shared buffer (rlactors.weight_sync.shared; made at the
        first call, in the generator dtype) and checksums it there, which waits for the packing
        to end. A collective: every rank calls it. Rank 0 returns the buffer's handle, the
        version packed, its checksum, the bytes and seconds (packing, checksum)."""
        start = time.perf_counter()
        if self._shared_gathers is None:
            layout = self.weight_layout(dtype)
            self.shared = SharedBuffer(layout, self.device) if self.rank == 0 else None
            self._shared_gathers = plan_packing(self._synced_parameters(), layout, layout.specs[0].torch_dtype,
                                                None if self.shared is None else self.shared.buffer, self.device)
        for gather in self._shared_gathers.values():
            gather.run()
        if self.shared is None:
            return None
        packed = time.perf_counter()
        checksum = self.shared.layout.checksum(self.shared.buffer)
        return {"handle": self.shared.handle, "version": self.version, "checksum": checksum,
                "bytes": float(self.shared.layout.total_bytes), "pack_s": packed - start,
                "checksum_s": time.perf_counter() - packed}

    def abort_weight_broadcast(self) -> None:
        """Rank 0 gives up a broadcast that waits for a dead member (`WeightSender.abort`)."""
        if self.sender is not None:
            self.sender.abort()

    def save_checkpoint(self, root: str | Path, step: int, extra_files: dict[str, str] | None = None) -> str:
        """Sharded DCP of model + optimizer, the policy as an HF dir, and the trainer state.

        `extra_files` (name -> text, e.g. the controller's state) are written inside the checkpoint
        before it is committed, so they are complete exactly when the checkpoint is.

        Written to a hidden partial dir and renamed to `<root>/step_XXXXXXXX` once complete;
        returns that path. Call at a step boundary (no accumulated gradients).
        """
        if self._accumulated:
            raise ValueError(f"save_checkpoint after {self._accumulated} forward_backward call(s) without "
                             "optim_step: accumulated gradients are not part of a checkpoint")
        final, partial = ckpt.checkpoint_dir(root, step), ckpt.partial_dir(root, step)

        def make_partial_dir() -> None:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crashed save
            partial.mkdir(parents=True)

        self._on_rank_0(make_partial_dir, f"save the checkpoint of step {step}", partial)
        # Before the first optim_step AdamW has no state, and asking DCP for it would create
        # some (a zero-gradient step): save the model alone then.
        has_optimizer_state = bool(self.optimizer.state)
        try:
            if has_optimizer_state:
                with self._optimizer_state_on_device():
                    model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._checkpointed)
                    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=partial / ckpt.DCP_DIR)
            else:
                dcp.save({"model": get_model_state_dict(self.model, options=self._checkpointed)},
                         checkpoint_id=partial / ckpt.DCP_DIR)
        except CheckpointException as e:  # a BaseException: raised on every rank
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise _first_failure(e, partial / ckpt.DCP_DIR) from None
        weights = self.full_weights(DTYPES[self.model_config.dtype])

        def export_and_commit() -> None:
            with writing(partial):  # a failed write() names no file: name the checkpoint at least
                if self.model_config.lora.rank:
                    adapters = {name: weights[name] for name in lora.adapter_parameters(self.model)}
                    save_peft_adapter(adapters, self.model_config.lora, self.model_config.path, partial / LORA_DIR)
                save_pretrained(self._merged(weights), self.args, partial / ckpt.HF_DIR)
                copy_tokenizer_files(self.model_config.path, partial / ckpt.HF_DIR)
                for name, text in (extra_files or {}).items():
                    (partial / name).write_text(text)
                ckpt.commit(partial, final, {"step": step, "policy_version": self.version,
                                             "optimizer_state": has_optimizer_state,
                                             "world_size": self.world_size})

        self._on_rank_0(export_and_commit, f"save the checkpoint of step {step}", partial)
        return str(final)

    def _on_rank_0(self, work: Callable[[], None], what: str, partial: Path) -> None:
        """Runs `work` on rank 0 while the other ranks wait for it (a barrier), and fails every
        rank when it fails: a rank never waits for one that has raised. A failed save removes its
        partial dir."""
        error = None
        if self.rank == 0:
            try:
                work()
            except Exception as e:  # noqa: BLE001 - raised again below, on every rank
                error = e
                shutil.rmtree(partial, ignore_errors=True)
        outcome = [None if error is None else (f"{type(error).__name__}: {error}",
                                               *((error.errno, error.strerror, error.filename)
                                                 if isinstance(error, OSError) else (None, None, None)))]
        dist.broadcast_object_list(outcome, src=0)
        if error is not None:
            raise error
        if outcome[0] is not None:
            text, errno, strerror, filename = outcome[0]
            if errno is not None:  # as rank 0's: a full disk is told as such whichever rank reports it
                raise OSError(errno, strerror, filename)
            raise RuntimeError(f"rank 0 failed to {what}: {text}")

    def load_checkpoint(self, path: str | Path) -> dict[str, int]:
        """Resumes from a complete trainer checkpoint, or starts over from an HF dir (step 0).

        Either way accumulated gradients and step stats are dropped. Returns step and version.
        """
        path = Path(path)
        if ckpt.looks_like_trainer_checkpoint(path):
            state = ckpt.read_state(path)
            self._discard_accumulation()
            if state["optimizer_state"]:
                with self._optimizer_state_on_device():
                    model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._checkpointed)
                    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path / ckpt.DCP_DIR)
                    set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                                   options=self._checkpointed)
            else:
                model_sd = get_model_state_dict(self.model, options=self._checkpointed)
                dcp.load({"model": model_sd}, checkpoint_id=path / ckpt.DCP_DIR)
                set_model_state_dict(self.model, model_sd, options=self._checkpointed)
                self._set_optimizer()
            self.version = self._tried_version = int(state["policy_version"])
            return {"step": int(state["step"]), "policy_version": self.version}
        if (path / "config.json").is_file():
            shapes = checkpoint_shapes(load_args(path))
            if shapes != checkpoint_shapes(self.args):
                raise ValueError(f"{path} holds a model of another shape than {self.model_config.path}")
            self._discard_accumulation()
            self._load_hf_weights(path)
            self._set_optimizer()
            self.version = self._tried_version = 0
            return {"step": 0, "policy_version": 0}
        raise ValueError(f"{path} is neither a trainer checkpoint nor a HF model dir")

    @contextlib.contextmanager
    def _optimizer_state_on_device(self) -> Iterator[None]:
        """The optimizer's state where DCP reads and writes it (the device) for the block; back in
        host memory after, when offloaded."""
        if self._offload is None:
            yield
            return
        self._offload.to_device()
        try:
            yield
        finally:
            self._offload.to_host()

    def _merged(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`full_weights` as plain HF weights: with `model.lora`, the adapters merged into the base."""
        return lora.merged_state(weights, self.model_config.lora) if self.model_config.lora.rank else weights

    def _discard_accumulation(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._stats, self._accumulated = LossStats(), 0


def _first_failure(error: CheckpointException, where: Path) -> Exception:
    """The error of a failed DCP save as one exception: the first rank's, an OSError naming the
    file (`where` when it names none)."""
    failures = [exc for exc, _ in error.failures.values()]
    for exc in failures:
        if isinstance(exc, OSError) and exc.errno is not None:
            return OSError(exc.errno, exc.strerror, exc.filename or str(where))
    first = failures[0] if failures else error
    return RuntimeError(f"saving {where} failed: {type(first).__name__}: {first}")
