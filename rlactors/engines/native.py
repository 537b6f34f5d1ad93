"""The native engine: continuous batching over rlactors' own decoder (any supported family), in
plain PyTorch.

One `step()` = schedule (scheduler.py) -> one packed forward over every scheduled chunk, decodes
and prefills mixed, attending over the paged KV cache (kv_cache.py, read by
paged_attention.py) -> sample the sequences whose chunk reached their last token
(sampling.py) -> report the ones that finished. A mixture-of-experts model's completions carry
the experts that each sampled token's forward was routed to (``Completion.routed_experts``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlactors.config import GeneratorConfig, LoraConfig, ModelConfig
from rlactors.engines.base import Engine, check_request
from rlactors.engines.kv_cache import BlockPool, PagedKVCache, blocks_for
from rlactors.engines.paged_attention import PagedAttention
from rlactors.engines.sampling import request_generator, sample
from rlactors.engines.scheduler import ScheduledChunk, Scheduler, SeqState
from rlactors.lora.adapters import adapter_parameters, attach_adapters, merge_adapters_
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.moe import SparseMoeBlock
from rlactors.on_policy.sides import sides
from rlactors.types import Completion, SamplingParams, TokenDelta
from rlactors.weight_sync.broadcast import LocalReceiver


class NativeEngine(Engine):
    """Serves `model`, sized by `config` (its max_num_seqs, max_num_tokens, kv_cache_tokens,
    block_size and max_model_len). With `true_on_policy` the model is converted in place to
    batch-invariant kernels (`rlactors.on_policy.sides`), so a token's logprob is the trainer's
    exactly. With `lora` (rank > 0) the model gets adapters (`rlactors.lora.adapters`): weight
    updates then carry the adapters alone, merged into the weights as they load."""

    def __init__(self, model: DecoderForCausalLM, config: GeneratorConfig, true_on_policy: bool = False,
                 lora: LoraConfig | None = None):
        self.model = model.eval().requires_grad_(False)
        param = next(model.parameters())
        self.device = param.device
        kernels = sides(true_on_policy, "native", self.device).generator
        if kernels.convert is not None:
            kernels.convert(model)
        self.lora = lora is not None and lora.rank > 0
        if self.lora:
            attach_adapters(model, lora)
        self.attention = kernels.attention or PagedAttention
        args = model.args
        self.vocab_size = args.vocab_size
        self.max_model_len = config.max_model_len
        self.version = 0
        num_blocks = blocks_for(config.kv_cache_tokens, config.block_size)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.cache = PagedKVCache(args.num_hidden_layers, num_blocks, config.block_size, args.num_key_value_heads,
                                  args.head_dim, kernels.kv_cache_dtype or param.dtype, self.device)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_tokens)
        self.sequences: dict[str, SeqState] = {}
        self.aborted: list[Completion] = []
        self.counters = {"steps": 0, "finished": 0, "aborted": 0, "generated_tokens": 0,
                         "computed_tokens": 0}
        # Each sparse layer's expert ids [T, k] of the step's forward, in layer order.
        self._routing: list[torch.Tensor] = []
        self.records_routing = False
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.experts.register_forward_hook(lambda _, inputs, out: self._routing.append(inputs[1]))
                self.records_routing = True

    @classmethod
    def from_config(cls, generator_config: GeneratorConfig, model_config: ModelConfig,
                    device: torch.device | str | None = None) -> NativeEngine:
        """Loads `model_config.path` in `model_config.dtype` and sizes the engine from a
        GeneratorConfig; the device defaults to CUDA when it is available."""
        from rlactors.models.checkpoint import from_pretrained

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = from_pretrained(model_config.path, dtype=model_config.dtype, device=device)
        return cls(model, generator_config, true_on_policy=model_config.true_on_policy, lora=model_config.lora)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams | Mapping[str, Any], streamed: bool = False) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        prompt, sampling = check_request(prompt_token_ids, sampling, self.vocab_size, self.max_model_len)
        seq = SeqState(request_id, prompt, len(prompt), sampling, request_generator(sampling.seed))
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def sampled(self, request_id: str, start: int = 0) -> TokenDelta | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        return TokenDelta(start, seq.token_ids[seq.prompt_len + start:], seq.logprobs[start:], seq.versions[start:])

    def abort(self, request_id: str) -> bool:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self.aborted.append(self._completion(seq, "abort"))
        self.counters["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.sequences or self.aborted)

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        finished, self.aborted = self.aborted, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return finished
        # Packed order: single-token chunks (decodes, by context length) first, then prefill chunks.
        scheduled.sort(key=lambda c: (c.num_tokens > 1, c.start if c.num_tokens == 1 else 0))
        hidden = self._forward(scheduled)
        sampled = self._sample(scheduled, hidden)
        for chunk in scheduled:
            self.scheduler.computed(chunk)
        now = time.perf_counter()
        for seq, token, logprob, experts in sampled:
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            if experts is not None:
                seq.routed_experts.append(experts)
            seq.versions.append(self.version)
            if seq.first_token is None:
                seq.first_token = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                del self.sequences[seq.request_id]
                self.scheduler.remove(seq)
                finished.append(self._completion(seq, reason))
                self.counters["finished"] += 1
        self.counters["steps"] += 1
        self.counters["generated_tokens"] += len(sampled)
        self.counters["computed_tokens"] += sum(c.num_tokens for c in scheduled)
        return finished

    def _forward(self, scheduled: list[ScheduledChunk]) -> torch.Tensor:
        input_ids, positions = [], []
        for c in scheduled:
            input_ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
            positions += range(c.start, c.start + c.num_tokens)
        attention = self.attention(self.cache, [c.as_chunk() for c in scheduled])
        self._routing.clear()
        return self.model(torch.tensor(input_ids, device=self.device),
                          torch.tensor(positions, device=self.device), attention)

    def _sample(self, scheduled: list[ScheduledChunk],
                hidden: torch.Tensor) -> list[tuple[SeqState, int, float, list[list[int]] | None]]:
        """(sequence, token, logprob, routed experts or None) for every chunk that reached its
        sequence's last token."""
        chunks, rows, end = [], [], 0
        for c in scheduled:
            end += c.num_tokens
            if c.samples:
                chunks.append(c)
                rows.append(end - 1)
        if not chunks:
            return []
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = sample(logits, [c.seq.sampling for c in chunks], [c.seq.generator for c in chunks],
                                     self.model.log_softmax)
        experts = [None] * len(chunks)
        if self.records_routing:  # [chunks, sparse layers, k]
            experts = torch.stack(self._routing, dim=1)[torch.tensor(rows, device=self.device)].tolist()
        return list(zip([c.seq for c in chunks], tokens.tolist(), logprobs.tolist(), experts))

    def _finish_reason(self, seq: SeqState, token: int) -> str | None:
        if token in seq.sampling.stop_token_ids:
            return "stop"
        if seq.num_generated >= seq.sampling.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _completion(self, seq: SeqState, reason: str) -> Completion:
        now = time.perf_counter()
        started = seq.first_scheduled or now
        first_token = seq.first_token or now
        return Completion(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[:seq.prompt_len],
            token_ids=seq.token_ids[seq.prompt_len:],
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            finish_reason=reason,
            routed_experts=list(seq.routed_experts) if self.records_routing else None,
            timings={"queue_s": started - seq.arrival, "prefill_s": first_token - started,
                     "decode_s": now - first_token})

    # -- weights and cache ------------------------------------------------------------------

    def _loaded_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters a weight update replaces: all of them, or with LoRA the adapters."""
        if self.lora:
            return adapter_parameters(self.model)
        return dict(self.model.named_parameters(remove_duplicate=False))

    def check_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        params = self._loaded_parameters()
        unknown = sorted(set(named_tensors) - set(params))
        tied = "lm_head.weight" if self.model.args.tie_word_embeddings else None
        missing = sorted(set(params) - set(named_tensors) - {tied})
        wrong_shape = [f"{n}: {tuple(t.shape)} != {tuple(params[n].shape)}"
                       for n, t in named_tensors.items() if n in params and t.shape != params[n].shape]
        if unknown or missing or wrong_shape:
            raise ValueError(f"weights do not match the model: unknown {unknown[:5]}, missing "
                             f"{missing[:5]}, wrong shapes {wrong_shape[:5]}")

    @torch.no_grad()
    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.check_weights(named_tensors)
        params = self._loaded_parameters()
        for name, tensor in named_tensors.items():
            params[name].copy_(tensor)
        if self.lora:
            merge_adapters_(self.model)
        self.version = version
        self.reset_prefix_cache()

    # Weights by broadcast: the receive buffer is not the model, so a receive may run while step() runs.
    stages_concurrently = True

    def broadcast_receiver(self) -> LocalReceiver:
        return LocalReceiver(self.device, self.load_weights)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "version": self.version,
            "waiting": len(s.waiting),
            "running": len(s.running),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.num_blocks,
            "preemptions": s.num_preemptions,
            "prompt_tokens": s.num_admitted_prompt_tokens,
            "prefix_hit_tokens": s.num_prefix_hit_tokens,
            **self.counters,
        }

    def close(self) -> None:
        for request_id in list(self.sequences):
            self.abort(request_id)
        self.aborted = []
