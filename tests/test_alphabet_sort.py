"""alphabet_sort: reward on hand-written answers, dataset determinism, full rollouts on the tiny tokenizer."""

import asyncio
import difflib
import random
import re

import pytest
from rlactors_examples.alphabet_sort.env import (
    COMBINED_TAG,
    FIRST_TAG,
    AlphabetSortConfig,
    AlphabetSortEnv,
    build_dataset,
    reference_reply,
    score_turn,
)

from rlactors.config import ConfigError, EnvConfig, RolloutConfig
from rlactors.models.tokenizer import load_tokenizer, render_messages
from rlactors.rollout import Rollouter, RolloutStatus, load_env
from rlactors.types import Completion

TURN1 = ["Alan Adams", "Finn Fox", "Kate Evans"]
TURN2 = ["Alan Adams", "Ben Cole // new name!", "Finn Fox", "Kate Evans"]


def block(tag, lines):
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def test_perfect_answer_scores_one_with_any_case_and_spacing():
    assert score_turn(block(FIRST_TAG, TURN1), TURN1, FIRST_TAG) == 1.0
    messy = f"Sure!\n<{FIRST_TAG}>\n  alan ADAMS \n\nFinn Fox\nkate evans\n</{FIRST_TAG}>\nDone."
    assert score_turn(messy, TURN1, FIRST_TAG) == 1.0


def test_missing_or_empty_or_wrong_tag_scores_zero():
    assert score_turn("Alan Adams\nFinn Fox\nKate Evans", TURN1, FIRST_TAG) == 0.0
    assert score_turn(f"<{FIRST_TAG}>\n\n</{FIRST_TAG}>", TURN1, FIRST_TAG) == 0.0
    assert score_turn(f"<{FIRST_TAG}>\nAlan Adams", TURN1, FIRST_TAG) == 0.0  # never closed
    # Turn 2 wants the combined tag; the turn-1 tag does not count (nor the reverse).
    assert score_turn(block(FIRST_TAG, TURN2), TURN2, COMBINED_TAG) == 0.0
    assert score_turn(block(COMBINED_TAG, TURN1), TURN1, FIRST_TAG) == 0.0


def test_wrong_order_scores_the_sequence_ratio_to_the_fourth():
    wrong = ["Kate Evans", "Alan Adams", "Finn Fox"]
    predicted, expected = "kate evans\nalan adams\nfinn fox", "alan adams\nfinn fox\nkate evans"
    ratio = difflib.SequenceMatcher(None, predicted, expected).ratio()
    score = score_turn(block(FIRST_TAG, wrong), TURN1, FIRST_TAG)
    assert score == pytest.approx(ratio ** 4) and 0.0 < score < ratio < 1.0
    assert score_turn(block(FIRST_TAG, wrong), TURN1, FIRST_TAG, power=1) == pytest.approx(ratio)


def test_extra_or_missing_names_lower_the_score():
    extra = score_turn(block(FIRST_TAG, TURN1 + ["Zoe Wood"]), TURN1, FIRST_TAG)
    missing = score_turn(block(FIRST_TAG, TURN1[:2]), TURN1, FIRST_TAG)
    assert 0.0 < extra < 1.0 and 0.0 < missing < 1.0


def test_later_turn_new_name_marks_are_scored():
    assert score_turn(block(COMBINED_TAG, TURN2), TURN2, COMBINED_TAG) == 1.0
    unmarked = [line.replace(" // new name!", "") for line in TURN2]
    wrong_mark = ["Alan Adams // new name!", "Ben Cole", "Finn Fox", "Kate Evans"]
    assert score_turn(block(COMBINED_TAG, unmarked), TURN2, COMBINED_TAG) < 1.0
    assert score_turn(block(COMBINED_TAG, wrong_mark), TURN2, COMBINED_TAG) < 1.0


def test_the_last_tagged_block_is_the_answer():
    wrong = block(FIRST_TAG, ["Kate Evans", "Alan Adams", "Finn Fox"])
    right = block(FIRST_TAG, TURN1)
    assert score_turn(wrong + "\nOops, fixed:\n" + right, TURN1, FIRST_TAG) == 1.0
    assert score_turn(right + "\n" + wrong, TURN1, FIRST_TAG) < 1.0


def test_dataset_is_deterministic_by_seed_and_respects_the_knobs():
    config = AlphabetSortConfig(seed=7, num_samples=50, min_turns=2, max_turns=3, min_names_per_turn=2,
                                max_names_per_turn=4)
    train = build_dataset(config, "train")
    assert train == build_dataset(AlphabetSortConfig(**vars(config)), "train")
    assert train != build_dataset(AlphabetSortConfig(**{**vars(config), "seed": 8}), "train")
    assert train[:10] != build_dataset(AlphabetSortConfig(**{**vars(config), "num_eval_samples": 10}), "eval")
    assert len(train) == 50 and {s["id"] for s in train} == set(range(50))
    assert {s["sort_by"] for s in train} == {"first", "last"}
    for s in train:
        assert 2 <= s["num_turns"] <= 3 and len(s["prompts"]) == len(s["expected"]) == s["num_turns"]
        assert all(2 <= len(names) <= 4 for names in s["turn_names"])
        everyone = [n for names in s["turn_names"] for n in names]
        part = 0 if s["sort_by"] == "first" else 1
        assert s["expected"][-1] == [n + (" // new name!" if n in s["turn_names"][-1] else "")
                                     for n in sorted(everyone, key=lambda n: n.split()[part].lower())]
        assert s["expected"][0] == sorted(s["turn_names"][0], key=lambda n: n.split()[part].lower())
        assert len({n.split()[0] for n in everyone}) == len({n.split()[1] for n in everyone}) == len(everyone)
    with pytest.raises(ValueError, match="split"):
        build_dataset(config, "test")


@pytest.mark.parametrize("args", [{"max_turns": 2, "max_names_per_turn": 3}, {"max_turns": 1, "max_names_per_turn": 1}])
def test_no_eval_sample_repeats_a_train_sample(args):
    """Small tasks draw some samples again; the eval split skips those the train split holds (the
    CPU demo's task drew 4 of its first 200 eval samples from the train split)."""
    config = AlphabetSortConfig(**args)
    train = {tuple(s["prompts"]) for s in build_dataset(config, "train")}
    held_out = build_dataset(config, "eval")
    assert len(held_out) == 200 and [s["id"] for s in held_out] == list(range(200))
    assert not any(tuple(s["prompts"]) in train for s in held_out)
    assert held_out == build_dataset(AlphabetSortConfig(**args), "eval")
    # A task too small to hold that many samples outside the train split says so.
    # (1 name of 1 turn: 36 x 31 names x 2 orders; 40000 train samples draw every one.)
    with pytest.raises(ConfigError, match=r"^env\.args\.num_eval_samples: only 0 of 5 eval samples differ "):
        build_dataset(AlphabetSortConfig(max_turns=1, max_names_per_turn=1, num_samples=40000, num_eval_samples=5),
                      "eval")


def test_generated_names_follow_the_length_knob():
    config = AlphabetSortConfig(names="generated", min_name_syllables=2, max_name_syllables=2, num_samples=20)
    for s in build_dataset(config, "train"):
        for name in (n for names in s["turn_names"] for n in names):
            assert all(re.fullmatch(r"[A-Z][a-z]{3}", part) for part in name.split())


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="env.args.min_turns"):
        AlphabetSortConfig(min_turns=3, max_turns=2)
    with pytest.raises(ConfigError, match="env.args.max_names_per_turn"):
        AlphabetSortConfig(max_turns=3, max_names_per_turn=20)
    with pytest.raises(ConfigError, match="env.args.sort_by"):
        load_env(EnvConfig(args={"sort_by": "middle"}), tokenizer=None)


class ScriptedChat:
    """A fake generator that answers each turn with a given reply function, encoded with the real tokenizer."""

    def __init__(self, tok, samples, reply, max_reply_tokens=None):
        self.tok, self.samples, self.reply, self.prompts = tok, samples, reply, {}
        self.max_reply_tokens = max_reply_tokens

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        group, _, turn = request_id.split("/")
        sample = self.samples[int(group[1:])]
        self.prompts[request_id] = list(prompt)
        tokens = self.tok.encode(self.reply(sample, int(turn[1:])), add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop"
        if len(tokens) > sampling.max_tokens:
            tokens, finish = tokens[:sampling.max_tokens], "length"
        return Completion(request_id, list(prompt), tokens, [-1.0] * len(tokens), [0] * len(tokens), finish)


def rollout_config(**overrides):
    return RolloutConfig(**{"group_size": 2, "max_turns": 3, "max_total_tokens": 1024,
                            "max_tokens_per_turn": 256, "keep_zero_variance_groups": True, **overrides})


def test_perfect_rollouts_score_one_and_pack_to_the_chat_rendering(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    env = load_env(EnvConfig(args={"seed": 1, "num_samples": 6, "min_turns": 3}), tok)
    samples = env.dataset("train")
    generate = ScriptedChat(tok, samples, reference_reply)
    batch = asyncio.run(Rollouter(env, generate, rollout_config()).collect(samples))
    assert batch.metrics["rollout/status/completed"] == 12.0
    assert all(r.reward == pytest.approx(1.0) for g in batch.groups for r in g.rollouts)
    assert len(batch.episodes) == 12  # one episode per 3-turn rollout
    for group, sample in zip(batch.groups, samples):
        episode = group.episodes[0]
        # The token-level extension equals the chat template's own rendering of the whole talk.
        conversation = []
        for k in range(3):
            conversation += [{"role": "user", "content": sample["prompts"][k]},
                             {"role": "assistant", "content": reference_reply(sample, k)}]
        assert episode.token_ids + tok.encode("\n", add_special_tokens=False) == render_messages(
            tok, conversation, add_generation_prompt=False)
        assert episode.token_ids[:len(generate.prompts[f"{group.group_id}/0/t2"])] == generate.prompts[
            f"{group.group_id}/0/t2"]
        generated = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
        assert generated == [t for turn in group.rollouts[0].turns for t in turn.token_ids]
        assert generated.count(tok.eos_token_id) == 3  # each turn's end is trained


def test_untagged_and_cut_off_replies(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    env = AlphabetSortEnv(AlphabetSortConfig(seed=2, num_samples=4, min_turns=2, max_turns=2), tok)
    samples = env.dataset("train")
    untagged = ScriptedChat(tok, samples, lambda s, k: "\n".join(s["expected"][k]))
    batch = asyncio.run(Rollouter(env, untagged, rollout_config()).collect(samples))
    assert all(r.reward == 0.0 and r.status == RolloutStatus.COMPLETED for g in batch.groups for r in g.rollouts)
    assert batch.metrics["rollout/groups_zero_variance"] == 4.0

    # Replies cut by max_tokens_per_turn end the rollout; the cut turn still scores (0: block never closed).
    cut = asyncio.run(Rollouter(env, ScriptedChat(tok, samples, reference_reply),
                                rollout_config(max_tokens_per_turn=6)).collect(samples))
    assert all(r.status == RolloutStatus.TRUNCATED_LENGTH and len(r.turns) == 1 and r.reward == 0.0
               for g in cut.groups for r in g.rollouts)


@pytest.mark.parametrize("rates", [None, (0.7, 0.0)])  # the CPU demo's teacher (the defaults), the GPU demo's
def test_warm_start_teacher_makes_its_two_mistakes_at_the_stated_rates(rates):
    from rlactors_examples.alphabet_sort.warm_start import TEACHER_UNSORTED, TEACHER_UNTAGGED, teacher_reply

    untagged_rate, unsorted_rate = rates or (TEACHER_UNTAGGED, TEACHER_UNSORTED)
    sample = build_dataset(AlphabetSortConfig(min_names_per_turn=3, max_names_per_turn=3), "train")[0]
    rng, n = random.Random(0), 4000
    replies = [teacher_reply(sample, 0, rng, *rates) if rates else teacher_reply(sample, 0, rng) for _ in range(n)]
    scores = [score_turn(reply, sample["expected"][0], FIRST_TAG) for reply in replies]
    untagged = sum(s == 0.0 for s in scores) / n
    perfect = sum(s == 1.0 for s in scores) / n
    # A random order of 3 names is the sorted one 1 time in 6, and then scores 1 too.
    assert untagged == pytest.approx(untagged_rate, abs=0.03)
    assert perfect == pytest.approx(1 - untagged_rate - unsorted_rate * 5 / 6, abs=0.03)
    first, second = random.Random(1), random.Random(1)
    assert [teacher_reply(sample, 0, first) for _ in range(50)] == [teacher_reply(sample, 0, second) for _ in range(50)]
