"""Policy-gradient losses of the GRPO family and SFT cross-entropy, per token with a loss mask.

A loss returns one microbatch's share of the step loss: its token sum divided by a denominator
that the controller fixes for the whole step (`LossNorm`). Summing the shares of every microbatch
on every rank gives the step loss, and its gradient, however the step was split.

Tokens enter a policy loss where `loss_mask` is set and the generator's logprob is finite; tokens
with a NaN/inf generator logprob are left out of both the sum and `LossNorm.num_tokens`, and
counted in the `nonfinite_logprob_tokens` metric. SFT ignores generator logprobs.

GRPO, DAPO and Dr.GRPO share the PPO-clipped surrogate. GRPO and DAPO normalise per token over the
step; DAPO is the asymmetric clip (`clip_high > clip_low`). Dr.GRPO divides by a constant instead.
Advantages arrive computed (with or without std normalisation: rlactors.rollout.advantages).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlactors.config import LossConfig, LossName

LOSS_NAMES = typing.get_args(LossName)
MAX_LOG_RATIO = 20.0  # |log p_trainer - log p_old| beyond this is clamped (ratio within e^±20)


class TokenBatch(Protocol):
    """What `LossNorm.for_step` reads from a microbatch (e.g. rlactors.trainer.batch.MicroBatch)."""

    positions: torch.Tensor
    loss_mask: torch.Tensor
    generator_logprobs: torch.Tensor


def loss_tokens(loss_name: str, loss_mask: torch.Tensor, generator_logprobs: torch.Tensor) -> torch.Tensor:
    """Bool mask of the tokens that enter the loss `loss_name`."""
    if loss_name not in LOSS_NAMES:
        raise ValueError(f"unknown loss {loss_name!r}; expected one of {LOSS_NAMES}")
    mask = loss_mask.bool()
    if loss_name == "sft":
        return mask
    return mask & torch.isfinite(generator_logprobs)


@dataclass(frozen=True)
class LossNorm:
    """Global counts of one optimizer step, over every microbatch of every rank.

    GRPO and DAPO divide by `num_tokens` (token-level mean over the step); Dr.GRPO by the constant
    `num_sequences * max_tokens` (no length normalisation); SFT by `num_tokens`.
    """

    num_tokens: int  # tokens that enter the loss (see `loss_tokens`)
    num_sequences: int = 0  # documents with at least one such token
    max_tokens: int = 0  # Dr.GRPO's constant sequence length: the generation budget per sequence

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LossNorm.{name} must be an integer >= 0, got {value!r}")

    def denominator(self, loss_name: str) -> float:
        if loss_name == "dr_grpo":
            if self.num_sequences < 1 or self.max_tokens < 1:
                raise ValueError(
                    "dr_grpo needs LossNorm.num_sequences >= 1 and max_tokens >= 1, got "
                    f"{self.num_sequences} and {self.max_tokens}"
                )
            return float(self.num_sequences * self.max_tokens)
        if self.num_tokens < 1:
            raise ValueError(f"{loss_name} needs LossNorm.num_tokens >= 1: the step has no loss tokens")
        return float(self.num_tokens)

    @classmethod
    def for_step(cls, microbatches: Iterable[TokenBatch], loss_name: str, max_tokens: int = 0) -> LossNorm:
        """Counts the loss tokens and sequences of every microbatch of a step (all ranks)."""
        num_tokens = num_sequences = 0
        for mb in microbatches:
            used = loss_tokens(loss_name, mb.loss_mask, mb.generator_logprobs)
            num_tokens += int(used.sum())
            # A document starts where positions restart at 0; number documents per row, then count
            # the distinct documents that hold at least one loss token.
            doc_ids = torch.cumsum(mb.positions == 0, dim=-1)
            for row_docs, row_used in zip(doc_ids.reshape(-1, doc_ids.shape[-1]), used.reshape(-1, used.shape[-1])):
                num_sequences += int(torch.unique(row_docs[row_used]).numel())
        return cls(num_tokens=num_tokens, num_sequences=num_sequences, max_tokens=max_tokens)


@dataclass
class LossStats:
    """Sums (and maxima) over loss tokens; they add over microbatches and reduce over ranks."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: LossStats) -> LossStats:
        sums = dict(self.sums)
        for key, value in other.sums.items():
            sums[key] = sums[key] + value if key in sums else value
        maxes = dict(self.maxes)
        for key, value in other.maxes.items():
            maxes[key] = torch.maximum(maxes[key], value) if key in maxes else value
        return LossStats(sums, maxes)

    def metrics(self) -> dict[str, float]:
        sums = {k: float(v) for k, v in self.sums.items()}
        tokens = sums.get("tokens", 0.0)
        out = {"loss": sums.get("loss", 0.0), "tokens": tokens}
        if "nonfinite_logprob_tokens" in sums:
            out["nonfinite_logprob_tokens"] = sums["nonfinite_logprob_tokens"]
        means = {"entropy": "entropy/mean", "ratio": "ratio/mean", "clipped": "clip_fraction"}
        for key, name in means.items():
            if key in sums:
                out[name] = sums[key] / tokens if tokens else 0.0
        if "current_policy_tokens" in sums:
            # The mismatch means are over the tokens the trainer's own policy generated, the lag's
            # over the rest (async mode: tokens of older versions).
            current = out["current_policy_tokens"] = sums["current_policy_tokens"]
            older = tokens - current
            for key in ("logprob_diff", "mismatch_kl"):
                out[f"{key}/mean"] = sums[key] / current if current else 0.0
            out["lag_logprob_diff/mean"] = sums["lag_logprob_diff"] / older if older else 0.0
        if "router_aux_loss" in sums:
            out["router_aux_loss"] = sums["router_aux_loss"]
        if "routed_tokens" in sums:
            # The share of them the trainer routed to other experts than the generator did.
            routed = out["routed_tokens"] = sums["routed_tokens"]
            out["expert_mismatch/share"] = sums["expert_mismatch"] / routed if routed else 0.0
        for key, value in self.maxes.items():
            out[f"{key}/max"] = float(value)
        return out


def compute_loss(
    config: LossConfig,
    norm: LossNorm,
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    generator_logprobs: torch.Tensor,
    entropy: torch.Tensor | None = None,
    current_policy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This microbatch's share of the step loss, and its stats.

    `logprobs` are the trainer's (with grad); the other tensors have its shape. `entropy`, when
    given, is only averaged into the stats. `current_policy` marks the tokens that the trainer's
    present weights generated (None: every token): the trainer/generator mismatch stats
    (`logprob_diff`, `mismatch_kl`) cover those, and `lag_logprob_diff` the others, whose
    difference is the policy's change since their version.
    """
    for name, tensor in (("loss_mask", loss_mask), ("advantages", advantages),
                         ("generator_logprobs", generator_logprobs), ("entropy", entropy),
                         ("current_policy", current_policy)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    used = loss_tokens(config.name, loss_mask, generator_logprobs)
    denominator = norm.denominator(config.name)
    stats = LossStats()
    if config.name == "sft":
        per_token = -logprobs
    else:
        if current_policy is None:
            current_policy = torch.ones_like(used)
        per_token, stats = _clipped_policy_loss(config, logprobs, advantages, generator_logprobs, used,
                                                current_policy.bool())
        dropped = loss_mask.bool() & ~torch.isfinite(generator_logprobs)
        stats.sums["nonfinite_logprob_tokens"] = dropped.sum().double()
    loss = torch.where(used, per_token, 0.0).sum() / denominator
    stats.sums["loss"] = loss.detach().double()
    stats.sums["tokens"] = used.sum().double()
    if entropy is not None:
        stats.sums["entropy"] = torch.where(used, entropy.detach(), 0.0).sum().double()
    return loss, stats


def _clipped_policy_loss(
    config: LossConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    generator_logprobs: torch.Tensor,
    used: torch.Tensor,
    current_policy: torch.Tensor,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped surrogate per token: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A).

    Without TIS, r is the ratio to the generator's probability. With TIS (`tis_cap > 0`) the
    trainer's own probability at this step is the old policy (one update per batch, so r = 1 with
    the gradient of log p) and the truncated weight min(p_trainer / p_generator, tis_cap)
    corrects the generator/trainer mismatch.
    """
    current = logprobs.detach()
    # Unused tokens get harmless values: NaN there would turn into NaN gradients through where().
    generator = torch.where(used, generator_logprobs, current)
    advantages = torch.where(used, advantages, 0.0)
    if config.tis_cap > 0:
        old = current
        weight = torch.exp(current - generator).clamp(max=config.tis_cap)
    else:
        old = generator
        weight = 1.0
    # A bounded log-ratio keeps exp() finite: an overflowing ratio would turn the zero gradient of
    # a clipped token into inf * 0 = NaN.
    ratio = torch.exp((logprobs - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped) * weight
    own, older = used & current_policy, used & ~current_policy
    gap = (current - generator).abs()
    diff, lag_diff = torch.where(own, gap, 0.0), torch.where(older, gap, 0.0)
    # KL(generator || trainer) per sampled token, k3 estimator: r - 1 - log r with r = p_trainer / p_generator.
    log_r = (current - generator).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    mismatch_kl = torch.where(own, torch.exp(log_r) - 1 - log_r, 0.0)
    stats = LossStats(
        sums={
            "ratio": torch.where(used, ratio.detach(), 0.0).sum().double(),
            "clipped": (used & (clipped > unclipped)).sum().double(),
            "current_policy_tokens": own.sum().double(),
            "logprob_diff": diff.sum().double(),
            "mismatch_kl": mismatch_kl.sum().double(),
            "lag_logprob_diff": lag_diff.sum().double(),
        },
        maxes={"logprob_diff": _max(diff), "lag_logprob_diff": _max(lag_diff)},
    )
    return per_token, stats


def _max(values: torch.Tensor) -> torch.Tensor:
    return values.max().double() if values.numel() else values.new_zeros((), dtype=torch.float64)
