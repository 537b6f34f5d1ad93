"""The generator contract shared by engines, generator actors, the router and rollouts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class SamplingParams:
    """How to sample one completion. `top_k=0` turns top-k off; `seed=None` samples unseeded."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        # Lists arrive from configs and messages; a tuple keeps the params hashable and safe to share.
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown SamplingParams key(s): {', '.join(unknown)}")
        return cls(**d)


def _zero_timings() -> dict[str, float]:
    return {"queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}


@dataclass
class Completion:
    """One finished generation request.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the unmodified (temperature 1,
    no top-k/p) distribution of the weights that sampled it; `versions[i]` is that policy version.
    For a mixture-of-experts model, when the engine records them, `routed_experts[i]` holds, for
    each sparse layer in order, the expert ids (most probable first) that computed the forward
    which sampled `token_ids[i]`.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    error: str | None = None
    replica: int | None = None
    timings: dict[str, float] = field(default_factory=_zero_timings)
    routed_experts: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                "Completion token_ids, logprobs and versions must have equal lengths, got "
                f"{len(self.token_ids)}, {len(self.logprobs)}, {len(self.versions)}"
            )


@dataclass
class TokenDelta:
    """Tokens a streamed request has sampled since the last delta: `token_ids[i]` is token
    `start + i` of its completion, with its logprob and policy version as in Completion."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class EngineDeadError(RuntimeError):
    """The engine loop has died; this generator cannot serve requests any more."""
