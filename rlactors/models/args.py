"""ModelArgs: a decoder's shape and family, read from and written to a Hugging Face ``config.json``.

Four families share one decoder (``rlactors.models.decoder``); ``config.json``'s ``model_type``
picks the family, and a family is the few switches in which they differ (``FAMILIES``):

- ``qwen3``: per-head RMSNorm of q and k before RoPE;
- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 whose sparse layers replace the MLP by a
  mixture of experts (``MoEArgs``);
- ``qwen2`` (Qwen2, Qwen2.5 and their R1 distills): biases on the q, k and v projections;
- ``llama`` (Llama 3, 3.1, 3.2): neither; usually with Llama 3's RoPE scaling.

Any of them may tie the LM head to the embedding and may use ``rope_type: llama3`` scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Family:
    """What sets a model family apart: the decoder's switches and its ``config.json`` spelling."""

    architecture: str  # config.json's "architectures" entry
    qkv_bias: bool  # the q, k and v projections carry biases
    qk_norm: bool  # q and k get a per-head RMSNorm before RoPE
    # Boolean config.json keys this family's HF model reads and rlactors does not implement: they
    # must be false (or absent), and are written false.
    unsupported_flags: tuple[str, ...]
    moe: bool = False  # sparse layers hold a mixture of experts (ModelArgs.moe)


FAMILIES: dict[str, Family] = {
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
                    unsupported_flags=("attention_bias", "use_sliding_window")),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
                        unsupported_flags=("attention_bias", "use_sliding_window", "output_router_logits"), moe=True),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, unsupported_flags=("use_sliding_window",)),
    "llama": Family("LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                    unsupported_flags=("attention_bias", "mlp_bias")),
}
ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """RoPE scaling ``rope_type: llama3`` (Llama 3.1 and later): inverse frequencies whose
    wavelength exceeds ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` are kept, and
    those between are interpolated (``decoder.rope_inverse_frequencies``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.low_freq_factor > 0:
            raise ValueError(f"rope_scaling factor and low_freq_factor must be positive, got {self}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling high_freq_factor must exceed low_freq_factor, got {self}")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive int, got {self}")

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True)
class MoEArgs:
    """The mixture of experts of a ``qwen3_moe`` model (its ``config.json`` keys, same names).

    Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    is not 0; dense layers keep the MLP of ``intermediate_size``. A sparse layer's router picks
    ``num_experts_per_tok`` of ``num_experts`` experts (MLPs of ``moe_intermediate_size``) per
    token by softmax probability and weighs their outputs by those probabilities, renormalized to
    sum to 1 with ``norm_topk_prob``. ``router_aux_loss_coef`` is carried for the checkpoint's
    sake: the trainer's coefficient is ``trainer.router_aux_loss_coef``.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # transformers' defaults from here on
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed "
                             f"num_experts ({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not all(isinstance(i, int) and i >= 0 for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must list layer indices, got {list(self.mlp_only_layers)}")
        if not isinstance(self.router_aux_loss_coef, (int, float)) or not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> MoEArgs:
        """The MoE keys of a ``qwen3_moe`` ``config.json``; absent ones take transformers' defaults
        (those of ``Qwen3MoeConfig``). transformers 5 writes ``num_experts`` as ``num_local_experts``."""
        return cls(
            num_experts=config.get("num_experts", config.get("num_local_experts", 128)),
            num_experts_per_tok=config.get("num_experts_per_tok", 8),
            moe_intermediate_size=config.get("moe_intermediate_size", 768),
            norm_topk_prob=config.get("norm_topk_prob", cls.norm_topk_prob),
            decoder_sparse_step=config.get("decoder_sparse_step", cls.decoder_sparse_step),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            router_aux_loss_coef=config.get("router_aux_loss_coef", cls.router_aux_loss_coef),
        )

    def to_hf(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    model_type: str = "qwen3"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0  # transformers' default when config.json names none
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False  # transformers' default for all three families
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    moe: MoEArgs | None = None  # the experts, exactly when the family is a mixture of experts

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {sorted(FAMILIES)}, got {self.model_type!r}")
        if (self.moe is not None) != self.family.moe:
            raise ValueError(f"model_type {self.model_type!r} {'needs' if self.family.moe else 'takes no'} MoEArgs")
        if self.moe is not None and any(i >= self.num_hidden_layers for i in self.moe.mlp_only_layers):
            raise ValueError(f"mlp_only_layers {list(self.moe.mlp_only_layers)} name layers beyond "
                             f"num_hidden_layers ({self.num_hidden_layers})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` holds a mixture of experts (transformers' rule)."""
        moe = self.moe
        return (moe is not None and layer_idx not in moe.mlp_only_layers
                and (layer_idx + 1) % moe.decoder_sparse_step == 0)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Reads a ``config.json`` dict of a supported family; rejects, naming the key, what the
        decoder does not implement. Absent keys take transformers' defaults."""
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"config.json has model_type {model_type!r}; rlactors supports {sorted(FAMILIES)}")
        for key in FAMILIES[model_type].unsupported_flags:
            if config.get(key):
                raise ValueError(f"config.json sets {key}=true, which rlactors' {model_type} does not support")
        layer_types = config.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"config.json's layer_types {sorted(set(layer_types))} ask for attention other than "
                             "full_attention, which rlactors does not support")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {config['hidden_act']!r}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"config.json is missing {missing}")
        rope_theta, rope_scaling = _read_rope(config)
        heads = config["num_attention_heads"]
        moe = MoEArgs.from_hf_config(config) if FAMILIES[model_type].moe else None
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            model_type=model_type,
            rms_norm_eps=float(config.get("rms_norm_eps", cls.rms_norm_eps)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", cls.tie_word_embeddings)),
            max_position_embeddings=config.get("max_position_embeddings", cls.max_position_embeddings),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or cls.torch_dtype),
            moe=moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict of this family that transformers (4.x and 5.x) and vLLM load."""
        family = self.family
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling.to_hf())
        config = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: rope_theta / rope_scaling for transformers 4.x readers,
            # rope_parameters for 5.x.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            **dict.fromkeys(family.unsupported_flags, False),
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            # transformers 4.x reads torch_dtype, 5.x reads dtype.
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }
        if "use_sliding_window" in family.unsupported_flags:
            config.update(sliding_window=None, max_window_layers=self.num_hidden_layers)
        if self.moe is not None:
            config.update(self.moe.to_hf())
        return config

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once), computed without allocating."""
        d, h = self.head_dim, self.hidden_size
        projected = d * (self.num_attention_heads + 2 * self.num_key_value_heads)  # q, k and v outputs
        attn = h * projected + self.num_attention_heads * d * h
        attn += 2 * d if self.family.qk_norm else 0
        attn += projected if self.family.qkv_bias else 0
        layers = sum(attn + self._mlp_params(i, active=False) + 2 * h for i in range(self.num_hidden_layers))
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + layers + h + lm_head

    def num_active_params(self) -> int:
        """Parameters a token computes with: ``num_params`` with each sparse layer's experts
        counted ``num_experts_per_tok`` times instead of ``num_experts`` (the count MFU uses)."""
        saved = sum(self._mlp_params(i, active=False) - self._mlp_params(i, active=True)
                    for i in range(self.num_hidden_layers))
        return self.num_params() - saved

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        h = self.hidden_size
        if not self.is_sparse_layer(layer_idx):
            return 3 * h * self.intermediate_size
        experts = self.moe.num_experts_per_tok if active else self.moe.num_experts
        return experts * 3 * h * self.moe.moe_intermediate_size + self.moe.num_experts * h  # + the router


def _read_rope(config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """``(rope_theta, scaling)`` as transformers reads them: ``rope_scaling`` (4.x) over
    ``rope_parameters`` (5.x); ``rope_theta`` inside that dict over the top-level key."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", ModelArgs.rope_theta)))
    partial = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"config.json sets partial_rotary_factor={partial}, which rlactors does not support")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json asks for rope_type {rope_type!r}; rlactors supports {list(ROPE_TYPES)}")
    if rope_type == "default":
        return rope_theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise ValueError(f"config.json's rope_type 'llama3' is missing {missing}")
    # transformers falls back to max_position_embeddings, as here.
    original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    return rope_theta, Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]), original_max_position_embeddings=original)
