"""The vLLM engine (GPU): vLLM's LLMEngine run in-process behind the Engine interface.

In true on-policy mode vLLM runs our own model (`rlactors.on_policy.vllm_model`), so that every
logprob it returns is the trainer's bit for bit.

vLLM is imported inside `from_config` only, so CPU installs never need it. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): weights are loaded straight into the model with
its own `load_weights` (HF names; vLLM fuses qkv / gate_up itself), through `apply_model`, which
reaches every tensor-parallel worker. Logprobs are vLLM's `raw_logprobs` of the sampled token:
the unmodified distribution, before temperature and top-k/top-p. With `model.lora` loads carry
the adapters alone, merged into the replica's kept base (`rlactors.lora.replica`).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import gc
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlactors import vllm_api
from rlactors.config import GeneratorConfig, ModelConfig
from rlactors.engines.base import Engine, check_request
from rlactors.lora.adapters import initial_adapters_of, scale
from rlactors.lora.replica import load_adapters
from rlactors.procs.placement import expandable_segments, set_expandable_segments
from rlactors.types import Completion, SamplingParams, TokenDelta
from rlactors.weight_sync.broadcast import VLLMReceiver
from rlactors.weight_sync.updates import stages_concurrently


@contextlib.contextmanager
def one_start_per_gpu(tp: int) -> Iterator[None]:
    """Holds, for each GPU this engine will use, a lock of this host that every vLLM engine
    starting on that GPU takes: engines that share a GPU start one after another.

    vLLM sizes its KV cache from the memory it measures while it starts; another engine starting
    on the same GPU at the same time changes that memory under it (and one of them can fail with
    no memory left for its cache). GPUs are named as CUDA_VISIBLE_DEVICES names them (each
    replica's proc has it set to its GPUs); unset, the engine uses GPUs 0..tp-1.

    POSIX record locks (``lockf``), not ``flock``: a process forked while the lock is held (vLLM's
    engine core, when it runs in a process of its own) would share an ``flock`` and keep the GPU
    locked for its whole life.
    """
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpus = sorted(visible[:tp] if visible else [str(i) for i in range(tp)])  # one order: no deadlock
    with contextlib.ExitStack() as stack:
        for gpu in gpus:
            lock = stack.enter_context((Path(tempfile.gettempdir()) / f"rlactors_vllm_start_gpu{gpu}.lock").open("w"))
            fcntl.lockf(lock, fcntl.LOCK_EX)
        yield


def custom_all_reduce_works(tp: int, alloc_conf: str | None = None) -> bool:
    """Whether vLLM's custom all-reduce can run for a replica of `tp` GPUs under PyTorch's
    allocator settings `alloc_conf` (by default this process's; `placement.expandable_segments`).
    It shares its buffers between GPUs by CUDA IPC handles, which memory from expandable segments
    cannot give: with those, vLLM's TP workers exit at CUDA graph capture
    ('custom_all_reduce.cuh: invalid argument', seen on vLLM 0.26)."""
    return tp == 1 or not expandable_segments(alloc_conf)


def without_expandable_segments(environ: dict[str, str]) -> None:
    """Drops `expandable_segments` from PyTorch's allocator settings in `environ` (both names it
    reads them under): vLLM's sleep mode allocates from a memory pool that refuses them
    (vLLM asserts at start, PyTorch issue 147851)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in environ:
            kept = [item for item in environ[name].split(",")
                    if item.strip() and not item.replace(" ", "").startswith("expandable_segments:")]
            environ[name] = ",".join(kept)


@dataclass
class _Request:
    prompt_token_ids: list[int]
    version: int  # the engine's version when the request was added
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _load_into_model(named_tensors: list[tuple[str, torch.Tensor]], model: torch.nn.Module,
                     lora_scale: float | None = None) -> None:
    if lora_scale is None:
        model.load_weights(weights=iter(named_tensors))
    else:
        load_adapters(model, named_tensors, lora_scale)


class VLLMEngine(Engine):
    """vLLM behind the Engine interface.

    With `hot_swaps` vLLM reports every request's new tokens after every step (its DELTA outputs),
    so a token sampled after a mid-request weight load carries the new version. Without, weights
    load only between requests (drain) and vLLM reports a request once, when it finishes (as its
    own `LLM.generate` does): building an output for every running request at every step costs
    the replica several milliseconds a step at a few hundred requests. A streamed request
    (`add_request(streamed=True)`) is reported every step either way.
    """

    def __init__(self, llm_engine: Any, vocab_size: int, max_model_len: int, tp: int = 1, version: int = 0,
                 hot_swaps: bool = True, sparse_layers: list[int] | None = None,
                 adapters: Mapping[str, torch.Tensor] | None = None, lora_scale: float | None = None):
        from rlactors.vllm_api import RequestOutputKind
        from rlactors.vllm_api import SamplingParams as VLLMSamplingParams

        self._vllm_params = VLLMSamplingParams
        self.hot_swaps = hot_swaps
        self.sparse_layers = sparse_layers  # the MoE layers whose routed experts vLLM returns, or None
        self._output_kind = RequestOutputKind.DELTA if hot_swaps else RequestOutputKind.FINAL_ONLY
        self._streamed_output_kind = RequestOutputKind.DELTA
        self.engine = llm_engine
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # One TP worker in this process stages (NCCL into the worker's buffer, on its own stream)
        # beside step().
        self.stages_concurrently = stages_concurrently(tp)
        self.version = version
        self.requests: dict[str, _Request] = {}
        # Completions the next step() returns besides its own: aborted ones, and those finished
        # while a weight load waited for the steps in flight.
        self.ready: list[Completion] = []
        self.counters = {"steps": 0, "finished": 0, "aborted": 0, "generated_tokens": 0}
        # With LoRA (`lora_scale` alpha / r): loads carry the adapters alone, `adapters` their
        # first values, merged now into the checkpoint's base (rlactors.lora.replica).
        self.lora_scale = lora_scale
        self.adapter_shapes = {name: t.shape for name, t in (adapters or {}).items()}
        if adapters:
            self.engine.apply_model(functools.partial(_load_into_model, list(adapters.items()),
                                                      lora_scale=lora_scale))

    @classmethod
    def from_config(cls, generator_config: GeneratorConfig, model_config: ModelConfig,
                    load_format: str = "auto", kv_cache_bytes: int | None = None) -> VLLMEngine:
        """A vLLM engine for `model_config.path`. In `model_config.true_on_policy` mode vLLM runs
        our own model with the trainer's kernels (`rlactors.on_policy.sides`). `load_format`:
        vLLM's; "dummy" serves random weights from a dir of config and tokenizer only (speed
        measurements at shapes whose weights do not fit the disk). `kv_cache_bytes`: the KV cache
        per GPU (the memory plan's, for replicas that sleep), else what vLLM's profile leaves in
        its gpu_memory_utilization share."""
        from rlactors.models.checkpoint import load_args
        from rlactors.on_policy.sides import sides

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        if generator_config.sleep:  # vLLM checks the variable; the allocator may be running already
            without_expandable_segments(os.environ)
            set_expandable_segments(False)
        kernels = sides(model_config.true_on_policy, "vllm", "cuda").generator
        os.environ.update(kernels.environment)  # read by vLLM's import
        model_args = load_args(model_config.path)
        mode_args = {}
        if kernels.engine_args is not None:
            kernels.register()
            mode_args = copy.deepcopy(kernels.engine_args)  # a module's constant: vLLM gets its own dicts
        # In default mode vLLM's own MoE layers record each token's experts (for the trainer's
        # expert-mismatch metric and routing replay); in true on-policy mode routing is the trainer's.
        sparse_layers = None
        if model_args.moe is not None and not model_config.true_on_policy:
            mode_args["enable_return_routed_experts"] = True
            sparse_layers = [i for i in range(model_args.num_hidden_layers) if model_args.is_sparse_layer(i)]
        from rlactors.vllm_api import EngineArgs, LLMEngine

        g = generator_config
        args = EngineArgs(
            model=model_config.path,
            dtype=model_config.dtype,
            tensor_parallel_size=g.tp,
            gpu_memory_utilization=g.gpu_memory_utilization,
            max_model_len=g.max_model_len,
            max_num_seqs=g.max_num_seqs,
            max_num_batched_tokens=g.max_num_tokens,
            enable_prefix_caching=True,
            logprobs_mode="raw_logprobs",
            disable_log_stats=True,
            disable_custom_all_reduce=not custom_all_reduce_works(g.tp),
            load_format=load_format,
            enable_sleep_mode=g.sleep,
            kv_cache_memory_bytes=kv_cache_bytes,
            **mode_args,
        )
        lora = model_config.lora
        adapters = initial_adapters_of(model_args, lora) if lora.rank else None  # bad targets fail before vLLM starts
        with one_start_per_gpu(g.tp):
            engine = LLMEngine.from_engine_args(args)
        return cls(engine, model_args.vocab_size, g.max_model_len, g.tp, hot_swaps=g.update_mode == "hot_swap",
                   sparse_layers=sparse_layers, adapters=adapters, lora_scale=scale(lora) if lora.rank else None)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling: SamplingParams | Mapping[str, Any], streamed: bool = False) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        prompt, sampling = check_request(prompt_token_ids, sampling, self.vocab_size, self.max_model_len)
        params = self._vllm_params(
            n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=True,  # only stop_token_ids end a completion early, as in the native engine
            logprobs=0, detokenize=False,
            output_kind=self._streamed_output_kind if streamed else self._output_kind)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        self.requests[request_id] = _Request(prompt, self.version)

    def step(self) -> list[Completion]:
        finished, self.ready = self.ready, []
        now = time.perf_counter()
        finished += self._take(self.engine.step(), now)
        self.counters["steps"] += 1
        return finished

    def _take(self, outputs: list[Any], started: float) -> list[Completion]:
        """The requests' new tokens from the `outputs` of one vLLM step, begun at `started`; the
        completions it finished."""
        finished = []
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is None:
                continue
            out = output.outputs[0]
            new = list(out.token_ids)  # this step's tokens (DELTA), or all of them once finished
            if new and request.first_token is None and self.hot_swaps:
                request.first_token = started
            request.token_ids += new
            request.logprobs += [entry[token].logprob for token, entry in zip(new, out.logprobs)]
            request.versions += [self.version if self.hot_swaps else request.version] * len(new)
            self.counters["generated_tokens"] += len(new)
            if output.finished:
                del self.requests[output.request_id]
                finished.append(self._completion(output.request_id, request, out.finish_reason,
                                                 self._routed_experts(request, out.routed_experts)))
                self.counters["finished"] += 1
        return finished

    def sampled(self, request_id: str, start: int = 0) -> TokenDelta | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        return TokenDelta(start, request.token_ids[start:], request.logprobs[start:], request.versions[start:])

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.engine.abort_request([request_id])
        self.ready.append(self._completion(request_id, request, "abort"))
        self.counters["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.ready)

    def check_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        super().check_weights(named_tensors)
        if self.lora_scale is not None and {n: t.shape for n, t in named_tensors.items()} != self.adapter_shapes:
            raise ValueError(f"weights do not match the model's LoRA adapters: unknown "
                             f"{sorted(set(named_tensors) - set(self.adapter_shapes))[:5]}, missing "
                             f"{sorted(set(self.adapter_shapes) - set(named_tensors))[:5]}, or shapes differ")

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.check_weights(named_tensors)
        with self._loading(version):
            self.engine.apply_model(functools.partial(_load_into_model, list(named_tensors.items()),
                                                      lora_scale=self.lora_scale))

    def broadcast_receiver(self) -> VLLMReceiver:
        """The trainer's NCCL weight broadcast, received by every TP worker."""
        return VLLMReceiver(self.engine, self._loading, self.lora_scale)

    @contextlib.contextmanager
    def _loading(self, version: int) -> Iterator[None]:
        """Around a weight load: after it, the engine's version is `version` and no cached prefix
        or running request keeps KV of the old weights."""
        with self._no_step_in_flight():
            yield
            self.version = version
            self._reset_running_requests()

    def reset_prefix_cache(self) -> None:
        with self._no_step_in_flight():
            self._reset_running_requests()

    def _reset_running_requests(self) -> None:
        # Running requests (hot swap) are preempted and recomputed on the new weights; their
        # sampled tokens of a step still in flight are dropped and resampled, so every returned
        # token is tagged with the version that produced it.
        self.engine.reset_prefix_cache(reset_running_requests=True)

    @contextlib.contextmanager
    def _no_step_in_flight(self) -> Iterator[None]:
        """vLLM resets the running requests of an engine that returns routed experts only while
        its scheduler is paused with no step in flight (its routed experts of a step in flight
        would be lost): those steps finish first, on the weights that started them, and their
        tokens keep the version they were sampled at. A scheduler paused already (asleep, woken in
        part) stays paused."""
        if self.sparse_layers is None or vllm_api.scheduler_paused(self.engine):
            yield
            return
        vllm_api.pause_scheduler(self.engine)
        try:
            while vllm_api.steps_in_flight(self.engine):
                started = time.perf_counter()
                self.ready += self._take(self.engine.step(), started)
            yield
        finally:
            vllm_api.resume_scheduler(self.engine)

    def sleep(self) -> None:
        # Level 1: weights to host memory, KV cache and prefix cache dropped. Level 2 would drop
        # the weights too, but outputs after its wake were seen to differ from before (something
        # besides the checkpoint's tensors is lost), so it is not used. The scheduler pauses
        # keeping its (no) requests: an engine returning routed experts resets only so.
        self.engine.sleep(level=1, mode="keep")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags=None if tags is None else list(tags))

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "running": len(self.requests), **self.counters}

    def close(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        self.ready = []
        vllm_api.shut_down(self.engine)
        self.engine = None
        gc.collect()
        torch.cuda.empty_cache()

    def _routed_experts(self, request: _Request, routed: Any) -> list[list[list[int]]] | None:
        """Each sampled token's experts per MoE layer (``Completion.routed_experts``), from what
        vLLM returns for a finished request: an array ``[prompt + generated - 1, num_hidden_layers,
        k]`` whose row ``p`` holds the experts of position ``p``'s forward, the one that sampled
        the token after it (rows of dense layers unused)."""
        if self.sparse_layers is None:
            return None
        prompt, generated = len(request.prompt_token_ids), len(request.token_ids)
        if routed is None or routed.shape[0] != prompt + generated - 1:
            raise RuntimeError(f"vLLM returned routed experts of shape {getattr(routed, 'shape', None)} for "
                               f"{prompt} prompt and {generated} generated tokens")
        return routed[prompt - 1:, self.sparse_layers].tolist()

    def _completion(self, request_id: str, request: _Request, reason: str | None,
                    routed_experts: list[list[list[int]]] | None = None) -> Completion:
        now = time.perf_counter()
        first_token = request.first_token or request.arrival
        return Completion(
            request_id=request_id, prompt_token_ids=request.prompt_token_ids, token_ids=request.token_ids,
            logprobs=request.logprobs, versions=request.versions, routed_experts=routed_experts,
            finish_reason=reason if reason in ("stop", "length", "abort") else "error",
            # vLLM keeps its own queue/prefill split; here, arrival to first token is "prefill" (without
            # hot swaps the first token is not seen alone: all of it counts as decode).
            timings={"queue_s": 0.0, "prefill_s": first_token - request.arrival, "decode_s": now - first_token})
