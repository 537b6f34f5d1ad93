"""Batcher: best-fit packing conserves every token and mask, balances ranks, reports padding."""

import math
import random
from collections import Counter

import pytest

from rlactors.config import BatcherConfig, ConfigError
from rlactors.rollout import Batcher, Episode, RolloutStatus

PAD = 0


def make_episode(rng, length, index):
    """Prompt, then alternating generated/env spans; every field distinct enough to trace."""
    tokens = [rng.randrange(1, 1000) for _ in range(length)]
    prompt = rng.randrange(1, max(2, length // 3))
    mask = [False] * prompt + [rng.random() < 0.7 for _ in range(length - prompt)]
    mask[-1] = True
    return Episode(
        token_ids=tokens, loss_mask=mask,
        generator_logprobs=[-rng.random() if m else 0.0 for m in mask],
        advantages=[index + 0.5 if m else 0.0 for m in mask],
        versions=[index % 7 if m else -1 for m in mask],
        group_id=f"g{index}", rollout_index=0, branch=0, reward=0.0, status=RolloutStatus.COMPLETED)


def row_documents(mb, r):
    """Row r of a microbatch split at positions == 0: one dict of fields per document."""
    starts = (mb.positions[r] == 0).nonzero().flatten().tolist() + [mb.positions.shape[1]]
    fields = [name for name, t in vars(mb).items() if t is not None]
    return [{name: getattr(mb, name)[r, a:b].tolist() for name in fields} for a, b in zip(starts, starts[1:])]


def documents(per_rank):
    return [d for mbs in per_rank for mb in mbs for r in range(mb.input_ids.shape[0]) for d in row_documents(mb, r)]


def split_real_and_padding(docs):
    real, padding = [], []
    for d in docs:
        is_pad = all(t == PAD for t in d["input_ids"]) and not any(d["loss_mask"])
        (padding if is_pad else real).append(d)
    return real, padding


def as_target_aligned(ep):
    return {
        "input_ids": ep.token_ids[:-1], "target_ids": ep.token_ids[1:],
        "positions": list(range(len(ep) - 1)), "loss_mask": ep.loss_mask[1:],
        "advantages": ep.advantages[1:], "generator_logprobs": ep.generator_logprobs[1:],
        "versions": ep.versions[1:],
    }


def key(d):
    return tuple(d["input_ids"]) + (-1,) + tuple(d["target_ids"])


@pytest.mark.parametrize("dp_size, rows_per_microbatch", [(1, 4), (2, 2), (3, 1)])
def test_packing_conserves_every_token_mask_and_value(dp_size, rows_per_microbatch):
    rng = random.Random(dp_size)
    episodes = [make_episode(rng, rng.randrange(2, 300), i) for i in range(60)]
    batcher = Batcher(BatcherConfig(row_tokens=512, rows_per_microbatch=rows_per_microbatch), dp_size, PAD)
    packed = batcher.pack(episodes)

    real, padding = split_real_and_padding(documents(packed.per_rank))
    expected = {key(as_target_aligned(e)): as_target_aligned(e) for e in episodes}
    assert Counter(key(d) for d in real) == Counter(key(as_target_aligned(e)) for e in episodes)
    for d in real:
        want = expected[key(d)]
        for name in want:
            assert d[name] == pytest.approx(want[name]), name
    for d in padding:
        assert d["positions"] == list(range(len(d["positions"])))
        assert d["versions"] == [-1] * len(d["versions"]) and not any(d["advantages"])

    # Global counts and the padding fraction, recomputed from the tensors.
    assert packed.num_loss_tokens == sum(sum(e.loss_mask[1:]) for e in episodes)
    assert packed.num_sequences == len(episodes)
    slots = sum(mb.input_ids.numel() for mbs in packed.per_rank for mb in mbs)
    real_tokens = sum(len(e) - 1 for e in episodes)
    assert packed.metrics["batcher/padding_fraction"] == pytest.approx(1 - real_tokens / slots)
    # Every rank runs the same number of microbatches, each of at most rows_per_microbatch rows.
    assert len(packed.per_rank) == dp_size
    assert len({len(mbs) for mbs in packed.per_rank}) == 1
    # At most rows_per_microbatch rows, as wide as the fullest row (never a column of pure padding).
    for mbs in packed.per_rank:
        for mb in mbs:
            rows, width = mb.input_ids.shape
            assert rows <= rows_per_microbatch and width <= 512
            fills = [sum(len(d["input_ids"]) for d in split_real_and_padding(row_documents(mb, r))[0])
                     for r in range(rows)]
            assert max(fills) == width or (width == 1 and not mb.loss_mask.any())  # or a 1-token filler


def test_best_fit_uses_close_to_the_minimum_number_of_rows_and_balances_ranks():
    rng = random.Random(0)
    episodes = [make_episode(rng, rng.randrange(40, 400), i) for i in range(200)]
    packed = Batcher(BatcherConfig(row_tokens=1024, rows_per_microbatch=4), dp_size=4).pack(episodes)
    total = sum(len(e) - 1 for e in episodes)
    assert packed.metrics["batcher/rows"] <= math.ceil(total / 1024) + 1
    assert packed.metrics["batcher/padding_fraction"] < 0.05
    real_per_rank = []
    for mbs in packed.per_rank:
        real, _ = split_real_and_padding(documents([mbs]))
        real_per_rank.append(sum(len(d["input_ids"]) for d in real))
    assert max(real_per_rank) - min(real_per_rank) <= 1024
    assert packed.metrics["batcher/rank_token_imbalance"] == pytest.approx(max(real_per_rank) / (total / 4))


def test_ranks_without_rows_get_all_masked_microbatches():
    rng = random.Random(1)
    packed = Batcher(BatcherConfig(row_tokens=64, rows_per_microbatch=2), dp_size=4).pack(
        [make_episode(rng, 30, 0), make_episode(rng, 50, 1)])
    assert [len(mbs) for mbs in packed.per_rank] == [1, 1, 1, 1]
    fillers = [mb for mbs in packed.per_rank for mb in mbs if not mb.loss_mask.any()]
    assert len(fillers) == 2
    for mb in fillers:  # one padding token: the cheapest forward_backward that keeps ranks in step
        assert mb.input_ids.shape == (1, 1) and mb.positions.tolist() == [[0]]


def test_overlong_episodes_are_truncated_or_dropped_and_counted():
    rng = random.Random(2)
    long_ep, short_ep = make_episode(rng, 100, 0), make_episode(rng, 20, 1)
    long_ep.loss_mask[:60] = [False] * 60
    long_ep.loss_mask[5] = True

    truncated = Batcher(BatcherConfig(row_tokens=32, overlong="truncate")).pack([long_ep, short_ep])
    assert truncated.metrics["batcher/overlong_truncated"] == 1.0
    assert truncated.num_sequences == 2
    real, _ = split_real_and_padding(documents(truncated.per_rank))
    assert sorted(len(d["input_ids"]) for d in real) == [19, 32]
    [cut] = [d for d in real if len(d["input_ids"]) == 32]
    assert cut["target_ids"] == long_ep.token_ids[1:33] and cut["loss_mask"] == long_ep.loss_mask[1:33]
    assert truncated.num_loss_tokens == 1 + sum(short_ep.loss_mask[1:])

    dropped = Batcher(BatcherConfig(row_tokens=32, overlong="drop")).pack([long_ep, short_ep])
    assert dropped.metrics["batcher/overlong_dropped"] == 1.0 and dropped.num_sequences == 1
    assert dropped.num_loss_tokens == sum(short_ep.loss_mask[1:])

    # Truncation that leaves no generated target drops the episode (and counts it).
    long_ep.loss_mask[5] = False
    nothing_left = Batcher(BatcherConfig(row_tokens=32)).pack([long_ep])
    assert nothing_left.metrics["batcher/overlong_dropped"] == 1.0 and nothing_left.num_sequences == 0


def test_no_episodes_gives_no_microbatches_and_bad_config_is_named():
    packed = Batcher(BatcherConfig(), dp_size=2).pack([])
    assert packed.per_rank == [[], []] and packed.num_loss_tokens == 0
    assert packed.metrics["batcher/padding_fraction"] == 0.0
    with pytest.raises(ConfigError, match="batcher.row_tokens"):
        Batcher(BatcherConfig(row_tokens=1))
    with pytest.raises(ValueError, match="dp_size"):
        Batcher(BatcherConfig(), dp_size=0)


def test_ranks_with_fewer_rows_spread_them_instead_of_padding():
    rng = random.Random(3)
    # Nine rows (no two 60-token episodes share a 64-slot row) over 2 ranks of <= 4 rows per call:
    # 5 + 4 rows -> 2 calls each as (3, 2) and (2, 2) rows; no all-padding microbatch is needed.
    packed = Batcher(BatcherConfig(row_tokens=64, rows_per_microbatch=4), dp_size=2).pack(
        [make_episode(rng, 60, i) for i in range(9)])
    assert sorted([mb.input_ids.shape[0] for mb in mbs] for mbs in packed.per_rank) == [[2, 2], [3, 2]]
    assert all(mb.loss_mask.any() for mbs in packed.per_rank for mb in mbs)
    calls = packed.forward_calls()
    assert len(calls) == 2 and all(len(call) == 2 for call in calls)
    assert calls[1][0] is packed.per_rank[0][1] and calls[0][1] is packed.per_rank[1][0]


def test_routed_experts_are_aligned_to_targets_like_the_logprobs():
    """An episode's routed experts (per generated token; None for context) land where its
    generator logprobs do; unknown slots and episodes without them are -1."""
    rng = random.Random(3)
    with_experts = [make_episode(rng, 30, i) for i in range(3)]
    for ep in with_experts:
        ep.routed_experts = [[[t % 8, (t + 1) % 8]] * 2 if m else None for t, m in zip(ep.token_ids, ep.loss_mask)]
    without = make_episode(rng, 20, 3)
    batch = Batcher(BatcherConfig(row_tokens=64, rows_per_microbatch=4)).pack([*with_experts, without])
    [mb] = batch.per_rank[0]
    assert mb.routed_experts.shape == (*mb.input_ids.shape, 2, 2)
    for r in range(mb.input_ids.shape[0]):
        for t in range(mb.input_ids.shape[1]):
            experts = mb.routed_experts[r, t].tolist()
            target = int(mb.target_ids[r, t])
            known = bool(mb.loss_mask[r, t]) and mb.versions[r, t] != 3  # the episode without experts
            assert experts == ([[target % 8, (target + 1) % 8]] * 2 if known else [[-1, -1]] * 2), (r, t)
    no_experts = Batcher(BatcherConfig(row_tokens=64, rows_per_microbatch=4)).pack([without])
    assert no_experts.per_rank[0][0].routed_experts is None
