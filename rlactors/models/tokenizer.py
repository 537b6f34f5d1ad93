"""Tokenizer loading, chat rendering and token-level prompt extension for multi-turn rollouts."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported when a tokenizer is loaded: it is slow to import
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
# A tokenizer's vocabulary is in one of these (vocab.json comes with merges.txt); without any,
# transformers builds a tokenizer of one token and says nothing.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# A stand-in conversation used to find what the chat template adds around new messages.
# Its assistant content is a marker that no real template emits by itself.
_DUMMY_HISTORY: list[Message] = [
    {"role": "system", "content": "rlactors-dummy-system"},
    {"role": "user", "content": "rlactors-dummy-user"},
    {"role": "assistant", "content": "rlactors-dummy-assistant"},
]
_ASSISTANT_MARKER = _DUMMY_HISTORY[-1]["content"]


def load_tokenizer(ckpt_dir: str | Path, model_vocab_size: int | None = None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, from local files only (never the network). Raises ValueError
    when the dir holds no vocabulary file, or when the tokenizer has more tokens than
    `model_vocab_size` (the model's embedding rows), given."""
    if not Path(ckpt_dir).is_dir():
        raise ValueError(f"tokenizer directory {ckpt_dir} does not exist")
    if not any((Path(ckpt_dir) / name).is_file() for name in VOCABULARY_FILES):
        raise ValueError(f"{ckpt_dir} has no tokenizer files (none of {', '.join(VOCABULARY_FILES)})")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt_dir), local_files_only=True)
    if model_vocab_size is not None and len(tok) > model_vocab_size:
        raise ValueError(f"the tokenizer of {ckpt_dir} has {len(tok)} tokens but the model's vocab_size is "
                         f"{model_vocab_size}: the tokenizer files belong to another model")
    return tok


def load_checked_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """`model.path`'s tokenizer, once `check_checkpoint_dir` found the dir whole; before any proc
    starts. Raises ConfigError, one line naming what is missing or wrong."""
    from rlactors.config import ConfigError
    from rlactors.models.checkpoint import check_checkpoint_dir

    try:
        args = check_checkpoint_dir(model_path)
        return load_tokenizer(model_path, args.vocab_size)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"model.path: {reason}") from None


def render_text(tok: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text of ``messages``; ``tools`` (OpenAI-style function specs) are
    rendered by the template, as it chooses to."""
    if not tok.chat_template:
        raise ValueError(f"tokenizer {tok.name_or_path!r} has no chat template; "
                         "use a checkpoint whose tokenizer_config.json sets chat_template")
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template's text already holds every special token it wants (BOS included).
    return tok.encode(text, add_special_tokens=False)


def render_messages(tok: PreTrainedTokenizerBase, messages: list[Message],
                    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered by the checkpoint's chat template."""
    if not messages:
        raise ValueError("messages must not be empty")
    return encode(tok, render_text(tok, messages, add_generation_prompt, tools))


def extend_with_messages(tok: PreTrainedTokenizerBase, prompt_ids: list[int], messages: list[Message],
                         add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """``prompt_ids + delta``: ``delta`` renders only the new ``messages`` after the existing turns.

    ``prompt_ids`` (earlier prompt plus generated tokens) are never re-tokenized: re-rendering
    the whole conversation could tokenize a completion differently from how it was sampled (or,
    like Qwen3's template, drop its thinking block), so the trainer would score tokens the
    policy never produced.

    How the delta is found without the real history: a fixed dummy history ending with an
    assistant turn is rendered alone and followed by the new messages. In both renderings the
    assistant's content (a marker string) is followed by the template's turn closing (ChatML:
    ``<|im_end|>\n``); in the second, the new messages come after that closing. Generation stops
    at a stop token, so ``prompt_ids`` usually end partway through the closing (``<|im_end|>``
    without ``\n``): the closing tokens they do not already end with start the delta, which also
    closes the turn of a completion cut off by the length limit. Templates that render earlier
    turns differently once more messages follow are fine (those turns are never re-rendered);
    a template that closes the assistant turn differently, or drops it, raises ValueError.
    ``tools`` are those the conversation was started with: a template may render later messages
    differently when tools are offered.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    closing, closing_ids = _closing(tok, tools)
    followed = render_text(tok, _DUMMY_HISTORY + list(messages), add_generation_prompt, tools)
    if followed.count(_ASSISTANT_MARKER) != 1:
        raise ValueError("the chat template does not render an earlier assistant turn once new "
                         "messages follow, so new messages cannot be appended token by token")
    after_assistant = followed[followed.index(_ASSISTANT_MARKER) + len(_ASSISTANT_MARKER):]
    if not after_assistant.startswith(closing):
        raise ValueError(f"the chat template closes an assistant turn with {closing!r} when it is last "
                         "but differently when messages follow, so the delta is ambiguous")
    already_closed = next(k for k in range(len(closing_ids), -1, -1)
                          if k == 0 or list(prompt_ids[-k:]) == closing_ids[:k])
    delta = closing_ids[already_closed:] + encode(tok, after_assistant[len(closing):])
    return list(prompt_ids) + delta


# tokenizer -> {(chat template, tools as JSON): (closing, its ids)}: one render per turn, not two
_CLOSINGS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], tuple[str, list[int]]]] = weakref.WeakKeyDictionary()
_MAX_CLOSINGS = 64  # distinct tool sets remembered per tokenizer


def _closing(tok: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """The text (and tokens) the chat template closes an assistant turn with when it is last."""
    key = (str(tok.chat_template), json.dumps(tools, sort_keys=True, default=str) if tools else "")
    known = _CLOSINGS.setdefault(tok, {})
    if key not in known:
        if len(known) >= _MAX_CLOSINGS:
            known.clear()
        alone = render_text(tok, _DUMMY_HISTORY, add_generation_prompt=False, tools=tools)
        closing = alone[alone.rindex(_ASSISTANT_MARKER) + len(_ASSISTANT_MARKER):]
        known[key] = closing, encode(tok, closing)
    closing, ids = known[key]
    return closing, list(ids)
