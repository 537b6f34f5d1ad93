"""The decoder (Qwen3, Qwen2/2.5, Llama 3.x), HF checkpoints, tokenizer helpers, and the trainer's packed
attention (``VarlenAttention``, from ``rlactors.attention``).

Random-init test checkpoints: ``rlactors.models.tiny`` (kept out of this namespace so that
``python -m rlactors.models.tiny`` runs cleanly)."""

from rlactors.attention.varlen import VarlenAttention
from rlactors.models.args import ModelArgs
from rlactors.models.checkpoint import copy_tokenizer_files, from_pretrained, load_args, save_pretrained
from rlactors.models.decoder import Attention, DecoderForCausalLM
from rlactors.models.tokenizer import extend_with_messages, load_checked_tokenizer, load_tokenizer, render_messages

__all__ = [
    "Attention",
    "DecoderForCausalLM",
    "ModelArgs",
    "VarlenAttention",
    "copy_tokenizer_files",
    "extend_with_messages",
    "from_pretrained",
    "load_args",
    "load_checked_tokenizer",
    "load_tokenizer",
    "render_messages",
    "save_pretrained",
]
