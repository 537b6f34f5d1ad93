"""The Engine interface shared by the native and vLLM engines, and the request checks they share.

An engine is synchronous and single-threaded: the caller adds requests, calls `step()` in a loop
and gets back the completions that finished in that step. Weights change only between steps, and
every sampled token carries the policy version of the weights that produced it.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlactors.types import Completion, SamplingParams, TokenDelta
from rlactors.weight_sync.broadcast import BroadcastReceiver


class Engine(abc.ABC):
    """Continuous-batching generation over token ids."""

    version: int  # policy version of the loaded weights

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams | Mapping[str, Any], streamed: bool = False) -> None:
        """Queues a request; raises ValueError (and keeps nothing) when the request is invalid.
        `streamed`: its tokens are read with `sampled` while it runs (an engine that otherwise
        collects a request's tokens only when it finishes collects them every step)."""

    @abc.abstractmethod
    def step(self) -> list[Completion]:
        """Runs one batched forward over the scheduled requests; returns those that finished."""

    @abc.abstractmethod
    def sampled(self, request_id: str, start: int = 0) -> TokenDelta | None:
        """The tokens an unfinished request has sampled so far, from its token `start` on; None
        when the request is not (or no longer) in the engine."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Stops a request; its completion (finish_reason "abort") comes out of the next step().

        Returns False when the request is unknown or already finished.
        """

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while some request (or an abort not yet reported) is still in the engine."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replaces the weights (HF parameter names) and sets the policy version of later tokens.

        Raises ValueError, with the old weights still in place, when `check_weights` fails.
        """

    def check_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Raises ValueError when `named_tensors` cannot be loaded; reads only shapes and names,
        so it may run while step() runs. This default only refuses an empty set."""
        if not named_tensors:
            raise ValueError("no weights given")

    # True: weights may load while requests run (a hot swap), each token tagged with the version
    # that produced it. False: loads only when no request runs (drain), and a request's tokens all
    # come from one version.
    hot_swaps = True

    # Weights broadcast by the trainer arrive in two phases (rlactors.weight_sync.updates): received
    # into a buffer beside the model and verified, then loaded between steps.
    stages_concurrently = False  # True: a receive may run in another thread while step() runs

    @abc.abstractmethod
    def broadcast_receiver(self) -> BroadcastReceiver:
        """This engine's receiving end of the trainer's weight broadcast (rlactors.weight_sync.broadcast)."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forgets cached prompt prefixes (their KV came from weights that are no longer current)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and gauges: requests waiting/running, tokens, steps, cache use."""

    def sleep(self) -> None:  # noqa: B027 - not abstract: an engine with nothing to free keeps it
        """Frees the device memory the engine can do without while it serves nothing (colocated
        with the trainer, `generator.sleep`); called only with no request in the engine. The
        native engine keeps its memory: it runs on CPUs and beside small models."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027 - see sleep
        """Takes back what `sleep` freed: `tags` "weights" or "kv_cache" (None: both), weights
        first, so that a weight load can come before the KV cache is allocated again."""

    def close(self) -> None:  # noqa: B027 - not abstract: an engine with nothing to release keeps it
        """Releases the engine's resources; the engine is unusable afterwards."""


def check_request(prompt_token_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any],
                  vocab_size: int, max_model_len: int) -> tuple[list[int], SamplingParams]:
    """Validates one request; returns the prompt as a list of ints and the SamplingParams.

    Raises ValueError naming the problem: an empty prompt, a token id outside the vocabulary, a
    prompt that leaves no room for one generated token, or sampling params that are not valid.
    """
    try:
        if isinstance(sampling, Mapping):
            sampling = SamplingParams.from_dict(dict(sampling))
        elif not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
        prompt = [operator.index(t) for t in prompt_token_ids]
    except TypeError as e:  # e.g. max_tokens="5", or a prompt that is not a list of ints
        raise ValueError(f"malformed request: {e}") from None
    if not prompt:
        raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens, which leaves no room to generate within the "
            f"context of max_model_len={max_model_len} tokens")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in sampling.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return prompt, sampling
