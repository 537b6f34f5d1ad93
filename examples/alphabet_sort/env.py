"""alphabet_sort: keep a list of names sorted across 1-3 chat turns.

Turn 1 gives a few names and asks for them sorted by first (or last) name inside
<alphabetical_sorted>. Each later turn gives more names and asks for the combined list inside
<combined_alphabetical_sorted>, with the names new in that turn marked `// new name!`.

Turn score: difflib SequenceMatcher ratio between the lines of the reply's last tagged block
and the expected lines (both lower-cased), to the power `similarity_power` (0 without a block).
Rollout reward: the sum of turn scores / the sample's number of turns, paid per turn as the
component "sort", so a rollout cut short keeps what it earned and loses the rest.

The dataset is generated from a seed, with no network: names come from a built-in list or from
a syllable generator, and the difficulty knobs (turns, names per turn, name length) make a
version a tiny model can learn.
"""

from __future__ import annotations

import difflib
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from rlactors.config import ConfigError
from rlactors.rollout import MessageEnv, MessageStep
from rlactors.types import Completion

FIRST_TAG = "alphabetical_sorted"
COMBINED_TAG = "combined_alphabetical_sorted"
NEW_MARK = "// new name!"
SPLITS = ("train", "eval")

FIRST_NAMES = """
Ada Alan Anna Ben Carl Cleo Dana Eli Emma Finn Grace Hugo Ida Ivan Jack Jane Kai Kate Leo Lily
Max Mia Nina Noah Omar Owen Paul Rosa Ruth Sam Sara Tom Uma Vera Will Zoe
""".split()
LAST_NAMES = """
Adams Baker Brown Clark Cole Davis Evans Fox Gray Hall Hill Hunt King Lane Lee Long Moore Nash
Owens Park Price Reed Rose Ross Shaw Stone Ward West White Wood Young
""".split()
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass
class AlphabetSortConfig:
    seed: int = 0
    num_samples: int = 2000  # train split; the eval split has num_eval_samples
    num_eval_samples: int = 200
    min_turns: int = 1
    max_turns: int = 3
    min_names_per_turn: int = 1
    max_names_per_turn: int = 5
    names: Literal["list", "generated"] = "list"  # built-in name list, or syllable-generated names
    min_name_syllables: int = 1  # generated names: syllables per first/last name
    max_name_syllables: int = 3
    sort_by: Literal["first", "last", "either"] = "either"  # "either": drawn per sample
    similarity_power: int = 4

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"env.args.{key}: {message}")

        need(self.num_samples >= 1, "num_samples", "must be >= 1")
        need(self.num_eval_samples >= 1, "num_eval_samples", "must be >= 1")
        need(1 <= self.min_turns <= self.max_turns, "min_turns", "must be in [1, max_turns]")
        need(1 <= self.min_names_per_turn <= self.max_names_per_turn, "min_names_per_turn",
             "must be in [1, max_names_per_turn]")
        need(1 <= self.min_name_syllables <= self.max_name_syllables, "min_name_syllables",
             "must be in [1, max_name_syllables]")
        need(self.similarity_power >= 1, "similarity_power", "must be >= 1")
        most = self.max_turns * self.max_names_per_turn
        need(self.names != "list" or most <= min(len(FIRST_NAMES), len(LAST_NAMES)), "max_names_per_turn",
             f"max_turns * max_names_per_turn = {most} exceeds the built-in name list; use names = 'generated'")


def _generated_part(rng: random.Random, config: AlphabetSortConfig) -> str:
    syllables = rng.randint(config.min_name_syllables, config.max_name_syllables)
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)).capitalize()


def _draw_names(rng: random.Random, config: AlphabetSortConfig, count: int) -> list[tuple[str, str]]:
    """`count` (first, last) pairs whose first names are distinct and last names are distinct,
    so the order is unambiguous whichever part is sorted by."""
    if config.names == "list":
        return list(zip(rng.sample(FIRST_NAMES, count), rng.sample(LAST_NAMES, count)))
    firsts: dict[str, None] = {}
    lasts: dict[str, None] = {}
    while len(firsts) < count:
        firsts[_generated_part(rng, config)] = None
    while len(lasts) < count:
        lasts[_generated_part(rng, config)] = None
    return list(zip(firsts, lasts))


def make_sample(rng: random.Random, config: AlphabetSortConfig, index: int) -> dict[str, Any]:
    num_turns = rng.randint(config.min_turns, config.max_turns)
    counts = [rng.randint(config.min_names_per_turn, config.max_names_per_turn) for _ in range(num_turns)]
    sort_by = config.sort_by if config.sort_by != "either" else rng.choice(["first", "last"])
    pairs = _draw_names(rng, config, sum(counts))
    part = 0 if sort_by == "first" else 1
    turn_names, prompts, expected, seen = [], [], [], []
    for k, count in enumerate(counts):
        new = pairs[len(seen):len(seen) + count]
        seen += new
        shown = new[:]
        rng.shuffle(shown)
        listed = ", ".join(f"{f} {last}" for f, last in shown)
        ordered = sorted(seen, key=lambda p: p[part].lower())
        if k == 0:
            prompts.append(
                f"Sort these names alphabetically by {sort_by} name: {listed}\n"
                f"Write one name per line inside <{FIRST_TAG}> and </{FIRST_TAG}>.")
            expected.append([f"{f} {last}" for f, last in ordered])
        else:
            prompts.append(
                f"Here are more names: {listed}\n"
                f"Sort ALL the names so far alphabetically by {sort_by} name, one per line inside "
                f"<{COMBINED_TAG}> and </{COMBINED_TAG}>. End the line of each name that is new "
                f"in this message with `{NEW_MARK}`.")
            expected.append([f"{f} {last}" + (f" {NEW_MARK}" if (f, last) in new else "") for f, last in ordered])
        turn_names.append([f"{f} {last}" for f, last in new])
    return {"id": index, "sort_by": sort_by, "num_turns": num_turns, "turn_names": turn_names,
            "prompts": prompts, "expected": expected}


# How many draws the eval split may take per sample it keeps, before the task counts as too small
# to hold num_eval_samples samples outside the train split.
MAX_EVAL_DRAWS_PER_SAMPLE = 100


def build_dataset(config: AlphabetSortConfig, split: str) -> list[dict[str, Any]]:
    """The split's samples; the same config always gives the same samples. No eval sample has the
    prompts of a train sample: a small task (few names and turns) draws some again, and those are
    skipped."""
    if split not in SPLITS:
        raise ValueError(f"alphabet_sort split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"alphabet_sort:{config.seed}:{split}")
    if split == "train":
        return [make_sample(rng, config, i) for i in range(config.num_samples)]
    train_prompts = {tuple(s["prompts"]) for s in build_dataset(config, "train")}
    samples: list[dict[str, Any]] = []
    for _ in range(MAX_EVAL_DRAWS_PER_SAMPLE * config.num_eval_samples):
        sample = make_sample(rng, config, len(samples))
        if tuple(sample["prompts"]) not in train_prompts:
            samples.append(sample)
            if len(samples) == config.num_eval_samples:
                return samples
    raise ConfigError(f"env.args.num_eval_samples: only {len(samples)} of {config.num_eval_samples} eval samples "
                      f"differ from every train sample; lower num_eval_samples or num_samples, or allow more "
                      f"names or turns")


def reference_reply(sample: dict[str, Any], turn: int) -> str:
    """A perfect reply to the sample's turn `turn` (0-based): the warm-start target."""
    tag = FIRST_TAG if turn == 0 else COMBINED_TAG
    return f"<{tag}>\n" + "\n".join(sample["expected"][turn]) + f"\n</{tag}>"


def last_tagged_block(text: str, tag: str) -> str | None:
    blocks = re.findall(f"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return blocks[-1] if blocks else None


def _normalized_lines(lines: list[str]) -> str:
    return "\n".join(line.strip().lower() for line in lines if line.strip())


def score_turn(reply: str, expected: list[str], tag: str, power: int = 4) -> float:
    """SequenceMatcher ratio of the last <tag> block's lines to `expected`, to the `power`."""
    block = last_tagged_block(reply, tag)
    if block is None:
        return 0.0
    predicted = _normalized_lines(block.split("\n"))
    if not predicted:
        return 0.0
    ratio = difflib.SequenceMatcher(None, predicted, _normalized_lines(expected)).ratio()
    return ratio ** power


class AlphabetSortEnv(MessageEnv):
    Config = AlphabetSortConfig

    def dataset(self, split: str) -> list[dict[str, Any]]:
        return build_dataset(self.config, split)

    async def start(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.sample, self.turn = sample, 0
        return [{"role": "user", "content": sample["prompts"][0]}]

    async def respond(self, reply: str, completion: Completion) -> MessageStep:
        sample, k = self.sample, self.turn
        tag = FIRST_TAG if k == 0 else COMBINED_TAG
        score = score_turn(reply, sample["expected"][k], tag, self.config.similarity_power)
        self.turn += 1
        reward = {"sort": score / sample["num_turns"]}
        info = {"turn_score": score}
        if self.turn == sample["num_turns"]:
            return MessageStep(None, reward, done=True, info=info)
        return MessageStep([{"role": "user", "content": sample["prompts"][self.turn]}], reward, info=info)
