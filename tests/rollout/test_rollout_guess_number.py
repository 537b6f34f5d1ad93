"""The guess_number example env (a plain TokenEnv) played through the Rollouter with scripted players."""

import asyncio

import pytest
from rlactors_examples.guess_number.env import GuessNumberConfig, GuessNumberEnv, parse_guess

from rlactors.config import ConfigError, EnvConfig, RolloutConfig
from rlactors.models.tokenizer import load_tokenizer
from rlactors.rollout import Rollouter, RolloutStatus, load_env
from rlactors.types import Completion


class BinarySearchPlayer:
    """Reads the env's last "Higher."/"Lower." from the prompt and halves the range."""

    def __init__(self, tok, low, high, fmt="<guess>{}</guess>"):
        self.tok, self.low, self.high, self.fmt = tok, low, high, fmt
        self.ranges, self.prompts = {}, []

    async def __call__(self, prompt, sampling, request_id, session_id=None):
        self.prompts.append(list(prompt))
        lo, hi, last = self.ranges.get(session_id, (self.low, self.high, None))
        text = self.tok.decode(prompt, skip_special_tokens=True)
        if last is not None:
            lo, hi = (last + 1, hi) if text.rstrip().endswith("Higher.") else (lo, last - 1)
        guess = (lo + hi) // 2
        self.ranges[session_id] = (lo, hi, guess)
        tokens = self.tok.encode(self.fmt.format(guess), add_special_tokens=False) + [self.tok.eos_token_id]
        return Completion(request_id, list(prompt), tokens, [-0.1] * len(tokens), [1] * len(tokens), "stop")


def run(tok, player, secret, **env_args):
    env = load_env(EnvConfig(name="rlactors_examples.guess_number.env:GuessNumberEnv", args=env_args), tok)
    config = RolloutConfig(group_size=2, max_turns=8, max_total_tokens=512, max_tokens_per_turn=16,
                           keep_zero_variance_groups=True)
    return asyncio.run(Rollouter(env, player, config).run_group({"id": 0, "secret": secret}))


def test_binary_search_solves_and_earns_the_rubric_rewards(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    # Range 1..16, secret 11: guesses 8 (higher), 12 (lower), 10 (higher), 11 -> 4 guesses of 5.
    player = BinarySearchPlayer(tok, 1, 16)
    group = run(tok, player, secret=11, low=1, high=16, max_guesses=5)
    for rollout in group.rollouts:
        assert rollout.status == RolloutStatus.COMPLETED
        assert [t.info["guess"] for t in rollout.turns] == [8, 12, 10, 11]
        assert rollout.reward_components == {"format": 4.0, "solved": 1.0, "speed": pytest.approx(0.25)}
        assert rollout.reward == pytest.approx(0.1 * 4 + 1.0 + 0.5 * 0.25)
    # Token in, token out: each prompt extends the previous prompt + completion exactly.
    episode = group.episodes[0]
    for prompt in player.prompts:  # both rollouts play the same game
        assert episode.token_ids[:len(prompt)] == prompt
    assert tok.decode(episode.token_ids, skip_special_tokens=True).count("Higher.") == 2


def test_unparsable_guesses_exhaust_the_guesses_with_no_reward(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    group = run(tok, BinarySearchPlayer(tok, 1, 16, fmt="maybe {}?"), secret=3, max_guesses=3)
    for rollout in group.rollouts:
        assert rollout.status == RolloutStatus.COMPLETED and len(rollout.turns) == 3
        assert rollout.reward == 0.0 and rollout.turns[0].info["feedback"] == "invalid"


def test_config_dataset_and_parsing(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    env = GuessNumberEnv(GuessNumberConfig(seed=5, num_samples=30, low=2, high=9), tok)
    data = env.dataset("train")
    assert data == GuessNumberEnv(GuessNumberConfig(seed=5, num_samples=30, low=2, high=9), tok).dataset("train")
    assert all(2 <= s["secret"] <= 9 for s in data) and len({s["secret"] for s in data}) > 3
    assert parse_guess("<guess>3</guess> no, <guess> 7 </guess>") == 7 and parse_guess("7") is None
    with pytest.raises(ConfigError, match="env.args.low"):
        GuessNumberConfig(low=5, high=5)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GuessNumberEnv()
