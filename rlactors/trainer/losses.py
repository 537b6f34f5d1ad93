"""Policy-gradient losses (GRPO family, GSPO, CISPO) and SFT cross-entropy, per token with a loss mask.

A loss returns one microbatch's share of the step loss: its token sum over a denominator the
controller fixes for the whole step (`LossNorm`), so the shares of every microbatch on every rank
sum to the step loss however the step was split. Tokens enter a policy loss where `loss_mask` is
set and the generator's logprob is finite (the others are counted in `nonfinite_logprob_tokens`).
GRPO, DAPO (asymmetric clip) and Dr.GRPO (a constant denominator) share the PPO-clipped surrogate;
GSPO clips a sequence-level ratio and averages per sequence; CISPO weighs a REINFORCE term by a
clipped, stop-gradient ratio. The mismatch corrections (truncated / masked IS, per token or per
sequence) and the reference KL apply to every policy loss. Advantages arrive computed
(rlactors.rollout.advantages). The formulas: docs/algorithms.md.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlactors.config import LossConfig, LossName

LOSS_NAMES = typing.get_args(LossName)
MAX_LOG_RATIO = 20.0  # |log p_trainer - log p_old| beyond this is clamped (ratio within e^±20)
QUANTILES = (0.05, 0.5, 0.95)
# Ratio quantiles come from a histogram of log-ratios u = asinh(log r / scale), in equal bins of u
# over +-MAX_LOG_RATIO: a fixed-size sum over microbatches and ranks, resolving log r to ~1e-5 near
# 0 and to ~1% of itself beyond 1e-3.
_HIST_SCALE, _HIST_BIN = 1e-3, 0.01
_HIST_LIMIT = math.asinh(MAX_LOG_RATIO / _HIST_SCALE)
_HIST_BINS = math.ceil(2 * _HIST_LIMIT / _HIST_BIN)


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

    GRPO, DAPO, CISPO and SFT divide by `num_tokens` (token-level mean over the step); Dr.GRPO by
    the constant `num_sequences * max_tokens` (no length normalisation); GSPO by `num_sequences`
    (each sequence's tokens weigh 1 / its length: a mean over sequences).
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
        if loss_name == "gspo":
            if self.num_sequences < 1:
                raise ValueError("gspo needs LossNorm.num_sequences >= 1: the step has no loss tokens")
            return float(self.num_sequences)
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
    """Sums, maxima and histograms (`ratio_histogram`) over loss tokens; they add over
    microbatches and reduce over ranks (histograms as sums)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    hists: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: LossStats) -> LossStats:
        sums, hists = dict(self.sums), dict(self.hists)
        for mine, theirs in ((sums, other.sums), (hists, other.hists)):
            for key, value in theirs.items():
                mine[key] = mine[key] + value if key in mine else value
        maxes = dict(self.maxes)
        for key, value in other.maxes.items():
            maxes[key] = torch.maximum(maxes[key], value) if key in maxes else value
        return LossStats(sums, maxes, hists)

    def metrics(self) -> dict[str, float]:
        sums = {k: float(v) for k, v in self.sums.items()}
        tokens = sums.get("tokens", 0.0)
        out = {"loss": sums.get("loss", 0.0), "tokens": tokens}
        if "nonfinite_logprob_tokens" in sums:
            out["nonfinite_logprob_tokens"] = sums["nonfinite_logprob_tokens"]
        means = {"entropy": "entropy/mean", "ratio": "ratio/mean", "clipped": "clip_fraction", "kl": "kl/mean",
                 "teacher_kl": "teacher_kl/mean",
                 "is_masked": "is_masked/share", "is_truncated": "is_truncated/share"}
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
        for key, hist in self.hists.items():
            out.update({f"{key}/p{round(q * 100)}": value for q, value in zip(QUANTILES, histogram_quantiles(hist))})
        return out


def ratio_histogram(log_ratios: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 counts of `log_ratios` (each counted `weights` times) in the quantile histogram's bins."""
    u = torch.asinh(log_ratios.double().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) / _HIST_SCALE)
    bins = ((u + _HIST_LIMIT) / _HIST_BIN).floor().long().clamp(0, _HIST_BINS - 1)
    return torch.zeros(_HIST_BINS, dtype=torch.float64, device=log_ratios.device).index_add_(0, bins, weights.double())


def histogram_quantiles(hist: torch.Tensor) -> list[float]:
    """The ratios at `QUANTILES` of a `ratio_histogram` (each its bin's middle; 0 when empty):
    the q-quantile is the least value with at least q of the counts at or below it."""
    cumulative = hist.double().cpu().cumsum(0)
    total = float(cumulative[-1])
    if total == 0:
        return [0.0] * len(QUANTILES)
    out = []
    for q in QUANTILES:
        index = int(torch.searchsorted(cumulative, torch.tensor(q * total, dtype=torch.float64)))
        u = -_HIST_LIMIT + (min(index, _HIST_BINS - 1) + 0.5) * _HIST_BIN
        out.append(math.exp(_HIST_SCALE * math.sinh(u)))
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
    positions: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This microbatch's share of the step loss, and its stats.

    `logprobs` are the trainer's (with grad); the other tensors have its shape. `entropy`, when
    given, is only averaged into the stats. `current_policy` marks the tokens that the trainer's
    present weights generated (None: every token): the trainer/generator mismatch stats
    (`logprob_diff`, `mismatch_kl`) cover those, and `lag_logprob_diff` the others, whose
    difference is the policy's change since their version. `positions` (restarting at 0 at each
    sequence) delimit the sequences for GSPO and sequence-level corrections; `reference_logprobs`
    are the frozen reference policy's, needed when `kl_coef > 0`.
    """
    for name, tensor in (("loss_mask", loss_mask), ("advantages", advantages),
                         ("generator_logprobs", generator_logprobs), ("entropy", entropy),
                         ("current_policy", current_policy), ("positions", positions),
                         ("reference_logprobs", reference_logprobs)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    used = loss_tokens(config.name, loss_mask, generator_logprobs)
    denominator = norm.denominator(config.name)
    stats = LossStats()
    if config.name == "sft":
        per_token = torch.where(used, -logprobs, 0.0)
    else:
        sequences = None
        if "sequence" in (config.tis_level, config.is_mask_level) or config.name == "gspo":
            if positions is None:
                raise ValueError(f"loss {config.name!r} with tis_level={config.tis_level!r}, "
                                 f"is_mask_level={config.is_mask_level!r} needs the tokens' positions")
            sequences = torch.cumsum(positions.reshape(-1) == 0, 0).reshape(positions.shape) - 1
        if config.kl_coef > 0 and reference_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs the reference policy's logprobs")
        if current_policy is None:
            current_policy = torch.ones_like(used)
        per_token, stats = _policy_loss(config, logprobs, advantages, generator_logprobs, used,
                                        current_policy.bool(), sequences, reference_logprobs)
        dropped = loss_mask.bool() & ~torch.isfinite(generator_logprobs)
        stats.sums["nonfinite_logprob_tokens"] = dropped.sum().double()
    loss = per_token.sum() / denominator
    stats.sums["loss"] = loss.detach().double()
    stats.sums["tokens"] = used.sum().double()
    if entropy is not None:
        stats.sums["entropy"] = torch.where(used, entropy.detach(), 0.0).sum().double()
    return loss, stats


def distillation_advantages(
    task_coef: float, coef: float, advantages: torch.Tensor, logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor, used: torch.Tensor,
) -> tuple[torch.Tensor, LossStats]:
    """On-policy distillation: per loss token (`used`), task_coef * A - coef * (log p - log p_teacher),
    the negated reverse-KL estimate on the student's own sample as a per-token reward (`logprobs`:
    the student's, no gradient); the stats sum that estimate (`teacher_kl/mean`)."""
    reverse_kl = torch.where(used, logprobs - teacher_logprobs, 0.0)
    shaped = torch.where(used, task_coef * advantages - coef * reverse_kl, advantages)
    return shaped, LossStats(sums={"teacher_kl": reverse_kl.sum().double()})


def _sequence_sum(values: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of `values` over the tokens of its sequence (`sequences`: ids from 0)."""
    flat = values.reshape(-1)
    sums = torch.zeros_like(flat).index_add_(0, sequences.reshape(-1), flat)
    return sums[sequences.reshape(-1)].reshape(values.shape)


def _policy_loss(
    config: LossConfig,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    generator_logprobs: torch.Tensor,
    used: torch.Tensor,
    current_policy: torch.Tensor,
    sequences: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
) -> tuple[torch.Tensor, LossStats]:
    """Per token (0 off the kept loss tokens), `config.name`'s loss times its correction weight,
    plus the reference KL term; and the stats.

    PPO family: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); GSPO the same with r the
    sequence's geometric-mean ratio (the gradient of each token's log p, GSPO-token's stop-gradient
    form), divided by the sequence's length; CISPO: -sg(clip(r, ...)) A log p. Without a mismatch
    correction r is the ratio to the generator's probability. With one, the trainer's own
    probability at this step is the old policy (one update per batch, so r = 1 with the gradient
    of log p), and the trainer/generator ratio rho (per token, or per sequence) is truncated into
    the weight min(rho, tis_cap) and/or masks the tokens where it leaves [is_mask_low, is_mask_high].
    """
    current = logprobs.detach()
    # Unused tokens get harmless values: NaN there would turn into NaN gradients through where().
    generator = torch.where(used, generator_logprobs, current)
    advantages = torch.where(used, advantages, 0.0)
    log_rho = (current - generator).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    stats = LossStats(hists={"is_ratio": ratio_histogram(log_rho, used)},
                      maxes={"is_ratio": _max(torch.where(used, log_rho.exp(), 0.0))})
    if sequences is not None:
        length = _sequence_sum(used.to(current.dtype), sequences).clamp(min=1)
        seq_log_rho = _sequence_sum(torch.where(used, log_rho, 0.0), sequences) / length
        if "sequence" in (config.tis_level, config.is_mask_level):
            # One count per sequence: each of its tokens counts 1 / its length.
            stats.hists["is_seq_ratio"] = ratio_histogram(seq_log_rho, used / length)
            stats.maxes["is_seq_ratio"] = _max(torch.where(used, seq_log_rho.exp(), 0.0))

    def ratio_at(level: str) -> torch.Tensor:
        return torch.exp(seq_log_rho if level == "sequence" else log_rho)

    weight, kept = torch.ones_like(current), used
    if config.tis_cap > 0:
        rho = ratio_at(config.tis_level)
        weight = rho.clamp(max=config.tis_cap)
        stats.sums["is_truncated"] = (used & (rho > config.tis_cap)).sum().double()
    if config.is_mask_high > 0:
        rho = ratio_at(config.is_mask_level)
        kept = used & (rho >= config.is_mask_low) & (rho <= config.is_mask_high)
        stats.sums["is_masked"] = (used & ~kept).sum().double()

    kl_term = 0.0
    if config.kl_coef > 0:
        reference = torch.where(used, reference_logprobs, current)
        if config.kl_estimator == "k1":
            kl = logprobs - reference
        else:  # k3: r - 1 - log r with r = p_reference / p_trainer
            log_r = (reference - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            kl = torch.exp(log_r) - 1 - log_r
        stats.sums["kl"] = torch.where(used, kl.detach(), 0.0).sum().double()
        if config.kl_as == "reward":
            advantages = advantages - config.kl_coef * kl.detach()
        else:
            kl_term = config.kl_coef * kl

    old = current if config.corrects_mismatch else generator
    log_ratio = logprobs - old
    if config.name == "gspo":
        # Value: the sequence's mean log-ratio; gradient: this token's log p.
        log_ratio = _sequence_sum(torch.where(used, log_ratio.detach(), 0.0), sequences) / length + log_ratio - \
            log_ratio.detach()
    # A bounded log-ratio keeps exp() finite: an overflowing ratio would turn the zero gradient of
    # a clipped token into inf * 0 = NaN.
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    low, high = 1 - config.clip_low, 1 + config.clip_high
    if config.name == "cispo":
        clipped_weight = ratio.detach().clamp(low, high)
        per_token = -clipped_weight * advantages * logprobs
        clipped = used & (clipped_weight != ratio.detach())
    else:
        unclipped = -advantages * ratio
        clipped_loss = -advantages * ratio.clamp(low, high)
        per_token = torch.maximum(unclipped, clipped_loss)
        clipped = used & (clipped_loss > unclipped)
    per_token = per_token * weight + kl_term
    if config.name == "gspo":
        per_token = per_token / length
    own, older = used & current_policy, used & ~current_policy
    gap = (current - generator).abs()
    diff, lag_diff = torch.where(own, gap, 0.0), torch.where(older, gap, 0.0)
    # KL(generator || trainer) per sampled token, k3 estimator: r - 1 - log r with r = p_trainer / p_generator.
    mismatch_kl = torch.where(own, torch.exp(log_rho) - 1 - log_rho, 0.0)
    stats.sums.update({
        "ratio": torch.where(used, ratio.detach(), 0.0).sum().double(),
        "clipped": clipped.sum().double(),
        "current_policy_tokens": own.sum().double(),
        "logprob_diff": diff.sum().double(),
        "mismatch_kl": mismatch_kl.sum().double(),
        "lag_logprob_diff": lag_diff.sum().double(),
    })
    stats.maxes.update({"logprob_diff": _max(diff), "lag_logprob_diff": _max(lag_diff)})
    return torch.where(kept, per_token, 0.0), stats


def _max(values: torch.Tensor) -> torch.Tensor:
    return values.max().double() if values.numel() else values.new_zeros((), dtype=torch.float64)
