"""DatasetEnv: one chat turn per record of a dataset, scored against the record's reference answer.

    [env]
    name = "rlactors.envs:DatasetEnv"
    args = { train_path = "data/gsm8k/train.parquet", eval_path = "data/gsm8k/test.parquet",
             prompt_field = "question", answer_field = "answer" }

Records come from `.jsonl`, `.parquet` (or a glob) or an HF `save_to_disk` dir (`rlactors.envs.data`).
The prompt field is a question put into `prompt_template` (after an optional `system_prompt`) or a
list of chat messages; the answer field a plain answer or a worked solution (`#### ANSWER`,
`\\boxed{ANSWER}`). The eval split is `eval_path` or a seeded `eval_fraction` of the train records.
A reply earns "correct" (the `extract` methods' answer matches the reference) and "format"
(`format_pattern` found), weighed by the rubric. The fields and keys in full: docs/data.md.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlactors.config import ConfigError
from rlactors.envs.data import DataError, Row, field_value, hold_out, read_rows
from rlactors.rollout import MessageEnv, MessageStep, Rubric
from rlactors.rollout.rewards import EXTRACTORS, answers_match, extract_answer, reference_answer, resolve_verifier
from rlactors.types import Completion

SPLITS = ("train", "eval")
PROMPT_SLOT = "{prompt}"


@dataclass
class DatasetEnvConfig:
    train_path: str = ""  # a .jsonl or .parquet file, a glob of them, or a save_to_disk directory
    eval_path: str = ""  # the eval split's data; "" = hold out eval_fraction of the train records
    eval_fraction: float = 0.0
    split_seed: int = 0  # which records eval_fraction holds out
    prompt_field: str = "question"  # dotted for nested records: "extra_info.question"
    answer_field: str = "answer"
    id_field: str = ""  # "" = FILE:ROW
    system_prompt: str = ""
    prompt_template: str = PROMPT_SLOT  # the user message; {prompt} is the prompt field
    chat_template: str = ""  # a Jinja chat template file replacing the checkpoint's; "" = the checkpoint's
    extract: tuple[Literal["boxed", "hash", "last_number"], ...] = EXTRACTORS
    verifier: Literal["auto", "builtin", "math_verify"] = "auto"  # auto: math_verify when installed
    correct_weight: float = 1.0
    format_weight: float = 0.1
    format_pattern: str = r"\\boxed\{.+\}"  # a regex (re.DOTALL) searched in the reply

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"env.args.{key}: {message}")

        need(bool(self.train_path), "train_path", "must name the training data (a .jsonl or .parquet file, "
             "a glob of them, or a directory saved by datasets.save_to_disk)")
        need(0 <= self.eval_fraction < 1, "eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        need(not (self.eval_path and self.eval_fraction), "eval_fraction",
             "give the eval split as eval_path or as eval_fraction, not both")
        need(bool(self.prompt_field), "prompt_field", "must name a field")
        need(bool(self.answer_field), "answer_field", "must name a field")
        need(PROMPT_SLOT in self.prompt_template, "prompt_template", f"must contain {PROMPT_SLOT}")
        need(not self.chat_template or Path(self.chat_template).is_file(), "chat_template",
             f"file not found: {self.chat_template}")
        need(len(self.extract) >= 1, "extract", f"must list at least one of {', '.join(EXTRACTORS)}")
        need(len(set(self.extract)) == len(self.extract), "extract", f"lists a method twice: {list(self.extract)}")
        for key in ("correct_weight", "format_weight"):
            need(math.isfinite(getattr(self, key)), key, f"must be finite, got {getattr(self, key)}")
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            need(False, "format_pattern", f"not a regular expression: {e}")


class DatasetEnv(MessageEnv):
    Config = DatasetEnvConfig

    def __init__(self, config: DatasetEnvConfig | None = None, tokenizer: Any = None) -> None:
        config = config if config is not None else DatasetEnvConfig()
        if config.chat_template and tokenizer is not None:
            tokenizer = copy.copy(tokenizer)  # the caller's tokenizer keeps its own template
            tokenizer.chat_template = Path(config.chat_template).read_text()
        super().__init__(config, tokenizer)
        self.verifier = resolve_verifier(config.verifier, "env.args.verifier")
        self.format_pattern = re.compile(config.format_pattern, re.DOTALL)
        self.rubric = Rubric(weights={"correct": config.correct_weight, "format": config.format_weight})

    def clone(self) -> DatasetEnv:
        # reset() sets every per-rollout attribute; the rest (tokenizer, patterns) is read-only.
        return copy.copy(self)

    def dataset(self, split: str) -> list[dict[str, Any]]:
        """The split's samples `{"id", "prompt", "answer"}`, in file order."""
        if split not in SPLITS:
            raise ValueError(f"DatasetEnv split must be one of {SPLITS}, got {split!r}")
        c = self.config
        if c.eval_path:
            return self._samples(c.train_path if split == "train" else c.eval_path)
        if not c.eval_fraction:
            if split == "eval":
                raise ConfigError("env.args.eval_path: no eval split: set eval_path or eval_fraction")
            return self._samples(c.train_path)
        samples = self._samples(c.train_path)
        try:
            train, held_out = hold_out(samples, c.eval_fraction, c.split_seed)
        except ValueError as e:
            raise DataError(f"env.args.eval_fraction: {c.train_path}: {e}") from None
        return train if split == "train" else held_out

    def _samples(self, path: str) -> list[dict[str, Any]]:
        c = self.config
        samples: list[dict[str, Any]] = []
        first_with: dict[str, Row] = {}  # id -> the row that has it
        for row in read_rows(path):
            sample_id = _text(row, c.id_field) if c.id_field else f"{Path(row.file).name}:{row.row}"
            if c.id_field and sample_id in first_with:
                first = first_with[sample_id]
                raise DataError(f"{row.where}: field {c.id_field!r} repeats the id {sample_id!r} of "
                                f"{'row ' + str(first.row) if first.file == row.file else first.where}")
            first_with[sample_id] = row
            prompt = field_value(row, c.prompt_field)
            prompt = _messages(row, c.prompt_field, prompt) if isinstance(prompt, list) else _text(row, c.prompt_field)
            answer = reference_answer(_text(row, c.answer_field))
            if answer is None:
                raise DataError(f"{row.where}: field {c.answer_field!r} marks an answer (#### or \\boxed{{}}) "
                                "but gives none")
            samples.append({"id": sample_id, "prompt": prompt, "answer": answer})
        return samples

    async def start(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.sample = sample
        prompt = sample["prompt"]
        if isinstance(prompt, list):
            system = [] if not self.config.system_prompt or prompt[0]["role"] == "system" else \
                [{"role": "system", "content": self.config.system_prompt}]
            return system + prompt
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return system + [{"role": "user", "content": self.config.prompt_template.replace(PROMPT_SLOT, prompt)}]

    async def respond(self, reply: str, completion: Completion) -> MessageStep:
        answer = extract_answer(reply, self.config.extract)
        correct = answer is not None and answers_match(answer, self.sample["answer"], self.verifier)
        reward = {"correct": float(correct), "format": float(self.format_pattern.search(reply) is not None)}
        return MessageStep(None, reward, done=True, info={"answer": answer})


def _text(row: Row, field: str) -> str:
    """The field as non-empty text (a number is written as text: answers are often numbers)."""
    value = field_value(row, field)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if value is None:
        raise DataError(f"{row.where}: field {field!r} is empty (null)")
    if not isinstance(value, str):
        raise DataError(f"{row.where}: field {field!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{row.where}: field {field!r} is empty")
    return value


def _messages(row: Row, field: str, value: list[Any]) -> list[dict[str, str]]:
    ok = bool(value) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                             and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{row.where}: field {field!r} must be text or a list of "
                        "{role, content} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]
