"""Rollout -> Episode: a whole multi-turn rollout becomes one packed training sequence.

Turn k's prompt normally extends turn k-1's prompt plus its completion (the env only appends).
Then the sequence is simply the last prompt plus the last completion, and every earlier turn's
tokens sit in it exactly as the generator saw them: the trainer scores the same token ids the
generator sampled, with the prefix computed once instead of once per turn. Generated tokens are
trained (loss_mask True); prompt and env tokens are context only.

If an env rewrites history (the next prompt is not an extension), the sequence so far is closed
and the rollout continues on a new branch episode that starts from the rewritten prompt.
"""

from __future__ import annotations

from rlactors.rollout.types import Episode, Rollout, Turn


class _EpisodeBuilder:
    def __init__(self, rollout: Rollout, branch: int) -> None:
        self.rollout = rollout
        self.branch = branch
        self.token_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routed_experts: list[list[list[int]] | None] | None = []  # None once a turn has none

    def extends(self, prompt: list[int]) -> bool:
        n = len(self.token_ids)
        return len(prompt) >= n and prompt[:n] == self.token_ids

    def add_turn(self, turn: Turn) -> None:
        context = turn.prompt_token_ids[len(self.token_ids):]
        self.token_ids += context
        self.loss_mask += [False] * len(context)
        self.logprobs += [0.0] * len(context)
        self.versions += [-1] * len(context)
        self.token_ids += turn.token_ids
        self.loss_mask += [True] * len(turn.token_ids)
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        if self.routed_experts is not None and turn.routed_experts is not None:
            self.routed_experts += [None] * len(context) + turn.routed_experts
        else:
            self.routed_experts = None

    def build(self) -> Episode:
        advantage = self.rollout.advantage
        return Episode(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            generator_logprobs=self.logprobs,
            advantages=[advantage if m else 0.0 for m in self.loss_mask],
            versions=self.versions,
            group_id=self.rollout.group_id,
            rollout_index=self.rollout.index,
            branch=self.branch,
            reward=self.rollout.reward,
            status=self.rollout.status,
            routed_experts=self.routed_experts,
        )


def rollout_to_episodes(rollout: Rollout) -> list[Episode]:
    """The rollout's episodes (one unless the env rewrote history), each with >= 1 loss token."""
    builders: list[_EpisodeBuilder] = []
    for turn in rollout.turns:
        if not builders or not builders[-1].extends(turn.prompt_token_ids):
            builders.append(_EpisodeBuilder(rollout, branch=len(builders)))
        builders[-1].add_turn(turn)
    return [b.build() for b in builders if any(b.loss_mask)]
