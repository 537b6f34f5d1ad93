"""Each loss against hand-computed values on small tensors (loss, gradient, metrics)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlactors.config import LossConfig
from rlactors.trainer.losses import LossNorm, LossStats, compute_loss, distillation_advantages

NAN, INF = float("nan"), float("inf")

# Four tokens; the last is not a loss token. Per token: r = exp(logp - generator logp).
LOGP = [-1.0, -0.5, -2.0, -0.3]
GEN = [-1.2, -0.5, -1.0, -0.3]
ADV = [1.0, -1.0, 1.0, 2.0]
MASK = [1, 1, 1, 0]


def run(config, norm, logp=LOGP, gen=GEN, adv=ADV, mask=MASK, entropy=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, stats = compute_loss(
        config, norm, logp, torch.tensor(mask), torch.tensor(adv, dtype=torch.float64),
        torch.tensor(gen, dtype=torch.float64), None if entropy is None else torch.tensor(entropy),
    )
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats.metrics()


def test_grpo_clips_the_ratio_against_generator_logprobs():
    loss, grad, m = run(LossConfig(name="grpo", clip_low=0.2, clip_high=0.2), LossNorm(num_tokens=6))
    r1, r3 = math.exp(0.2), math.exp(-1.0)
    # token 1: A > 0, r = 1.221 > 1.2 -> clipped at 1.2 (no gradient); token 2: r = 1, A = -1;
    # token 3: A > 0, r = 0.368 < 0.8 -> min picks the unclipped r; token 4 is masked.
    assert loss == pytest.approx((-1.2 + 1.0 - r3) / 6, abs=1e-12)
    assert grad == pytest.approx([0.0, 1.0 / 6, -r3 / 6, 0.0], abs=1e-12)
    assert m["tokens"] == 3 and m["clip_fraction"] == pytest.approx(1 / 3)
    assert m["ratio/mean"] == pytest.approx((r1 + 1 + r3) / 3)
    assert m["logprob_diff/mean"] == pytest.approx((0.2 + 0 + 1.0) / 3)
    assert m["logprob_diff/max"] == pytest.approx(1.0)
    # k3 estimate of KL(generator || trainer): r - 1 - log r per loss token, r = exp(logp - gen).
    assert m["mismatch_kl/mean"] == pytest.approx(((r1 - 1 - 0.2) + 0 + (r3 - 1 + 1.0)) / 3)
    assert m["nonfinite_logprob_tokens"] == 0


def test_grpo_clips_negative_advantages_from_below():
    # A < 0 and r = exp(-0.5) = 0.607 < 0.8: max(-A r, -A clip(r)) = 0.8 (clipped, no gradient).
    loss, grad, m = run(LossConfig(name="grpo"), LossNorm(num_tokens=1), logp=[-1.5], gen=[-1.0], adv=[-1.0], mask=[1])
    assert loss == pytest.approx(0.8) and grad == [0.0] and m["clip_fraction"] == 1.0


def test_an_overflowing_ratio_stays_finite_and_clipped():
    # exp(199) overflows fp32; the clamped log-ratio keeps the clipped token's loss and zero gradient finite.
    logp = torch.tensor([-1.0], requires_grad=True)
    loss, _ = compute_loss(LossConfig(name="grpo"), LossNorm(num_tokens=1), logp, torch.tensor([1]),
                           torch.tensor([1.0]), torch.tensor([-200.0]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logp.grad.tolist() == [0.0]


def test_dapo_asymmetric_clip_lets_the_upper_ratio_through():
    loss, grad, m = run(LossConfig(name="dapo", clip_low=0.2, clip_high=0.28), LossNorm(num_tokens=3))
    r1, r3 = math.exp(0.2), math.exp(-1.0)
    assert loss == pytest.approx((-r1 + 1.0 - r3) / 3, abs=1e-12)
    assert grad == pytest.approx([-r1 / 3, 1.0 / 3, -r3 / 3, 0.0], abs=1e-12)
    assert m["clip_fraction"] == 0.0


def test_dr_grpo_divides_by_sequences_times_max_tokens():
    norm = LossNorm(num_tokens=3, num_sequences=2, max_tokens=8)
    loss, grad, _ = run(LossConfig(name="dr_grpo"), norm)
    r3 = math.exp(-1.0)
    assert loss == pytest.approx((-1.2 + 1.0 - r3) / 16, abs=1e-12)
    assert grad == pytest.approx([0.0, 1.0 / 16, -r3 / 16, 0.0], abs=1e-12)


def test_truncated_importance_sampling_weights_by_capped_trainer_generator_ratio():
    # The trainer's own logprob is the old policy: r = 1 (never clipped), weight = min(exp(logp - gen), cap).
    config = LossConfig(name="grpo", tis_cap=1.1)
    loss, grad, m = run(config, LossNorm(num_tokens=3))
    w1, w3 = min(math.exp(0.2), 1.1), math.exp(-1.0)
    assert w1 == 1.1
    assert loss == pytest.approx((-w1 + 1.0 - w3) / 3, abs=1e-12)
    assert grad == pytest.approx([-w1 / 3, 1.0 / 3, -w3 / 3, 0.0], abs=1e-12)
    assert m["ratio/mean"] == 1.0 and m["clip_fraction"] == 0.0


def test_mismatch_stats_cover_the_current_policys_tokens_and_the_lag_the_older_ones():
    # Token 1 came from an older policy version (async): its difference is the policy's change.
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    current_policy = torch.tensor([False, True, True, True])
    _, stats = compute_loss(LossConfig(name="grpo"), LossNorm(num_tokens=3), logp, torch.tensor(MASK),
                            torch.tensor(ADV, dtype=torch.float64), torch.tensor(GEN, dtype=torch.float64),
                            current_policy=current_policy)
    m = stats.metrics()
    r3 = math.exp(-1.0)
    assert m["tokens"] == 3 and m["current_policy_tokens"] == 2
    assert m["logprob_diff/mean"] == pytest.approx((0 + 1.0) / 2) and m["logprob_diff/max"] == pytest.approx(1.0)
    assert m["mismatch_kl/mean"] == pytest.approx((0 + (r3 - 1 + 1.0)) / 2)
    assert m["lag_logprob_diff/mean"] == pytest.approx(0.2) and m["lag_logprob_diff/max"] == pytest.approx(0.2)
    # The loss itself covers every token, whichever policy generated it.
    assert m["ratio/mean"] == pytest.approx((math.exp(0.2) + 1 + r3) / 3)


def test_nonfinite_generator_logprobs_leave_numerator_and_are_counted():
    gen = [NAN, -0.5, -INF, INF]
    loss, grad, m = run(LossConfig(name="grpo"), LossNorm(num_tokens=1), gen=gen, mask=[1, 1, 1, 1])
    assert loss == pytest.approx(1.0)  # only token 2 (r = 1, A = -1)
    assert grad == [0.0, 1.0, 0.0, 0.0]
    assert m["tokens"] == 1 and m["nonfinite_logprob_tokens"] == 3
    assert m["logprob_diff/max"] == 0.0


def test_nonfinite_generator_logprobs_leave_the_step_count():
    mb = SimpleNamespace(positions=torch.tensor([[0, 1, 2, 0, 1, 2]]), loss_mask=torch.tensor([[0, 1, 1, 0, 1, 1]]),
                         generator_logprobs=torch.tensor([[0.0, NAN, -1.0, 0.0, -INF, NAN]]))
    assert LossNorm.for_step([mb], "grpo") == LossNorm(num_tokens=1, num_sequences=1)
    assert LossNorm.for_step([mb], "sft", max_tokens=5) == LossNorm(num_tokens=4, num_sequences=2, max_tokens=5)


def test_all_masked_rows_give_zero_loss_and_zero_finite_gradient():
    for name in ("grpo", "dapo", "dr_grpo", "sft"):
        norm = LossNorm(num_tokens=5, num_sequences=1, max_tokens=4)
        loss, grad, m = run(LossConfig(name=name), norm, gen=[NAN] * 4, mask=[0, 0, 0, 0], entropy=[1.0] * 4)
        assert loss == 0.0 and grad == [0.0] * 4, name
        assert m["tokens"] == 0 and m["entropy/mean"] == 0.0
        if name != "sft":
            assert m["ratio/mean"] == 0.0 and m["nonfinite_logprob_tokens"] == 0


def test_sft_is_masked_cross_entropy_over_the_step_tokens_and_ignores_generator_logprobs():
    loss, grad, m = run(LossConfig(name="sft"), LossNorm(num_tokens=4), gen=[NAN] * 4, entropy=[0.5, 1.0, 1.5, 9.0])
    assert loss == pytest.approx((1.0 + 0.5 + 2.0) / 4)
    assert grad == [-0.25, -0.25, -0.25, 0.0]
    assert m["entropy/mean"] == pytest.approx(1.0)
    assert "ratio/mean" not in m and "logprob_diff/max" not in m


def test_loss_does_not_depend_on_how_the_step_is_split():
    torch.manual_seed(0)
    n = 10
    logp = -torch.rand(n, dtype=torch.float64) * 3
    gen = logp + 0.3 * torch.randn(n, dtype=torch.float64)
    gen[3] = NAN
    adv, mask = torch.randn(n, dtype=torch.float64), (torch.rand(n) > 0.3).long()
    config = LossConfig(name="dapo", clip_high=0.28)
    norm = LossNorm.for_step([SimpleNamespace(positions=torch.arange(n)[None], loss_mask=mask[None],
                                              generator_logprobs=gen[None])], "dapo")

    def grads(splits):
        x = logp.clone().requires_grad_(True)
        stats = LossStats()
        for part in torch.tensor_split(torch.arange(n), splits):
            loss, s = compute_loss(config, norm, x[part], mask[part], adv[part], gen[part])
            loss.backward()
            stats = stats.merge(s)
        return x.grad, stats.metrics()

    whole, m_whole = grads([])
    split, m_split = grads([2, 7])
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-15)
    assert m_split == pytest.approx(m_whole)
    assert m_whole["tokens"] == norm.num_tokens


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        run(LossConfig(name="grpo"), LossNorm(num_tokens=0))
    with pytest.raises(ValueError, match="num_sequences >= 1 and max_tokens >= 1"):
        run(LossConfig(name="dr_grpo"), LossNorm(num_tokens=3, num_sequences=2))
    with pytest.raises(ValueError, match="advantages has shape"):
        run(LossConfig(name="grpo"), LossNorm(num_tokens=3), adv=[1.0, 2.0])
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        run(LossConfig(name="ppo"), LossNorm(num_tokens=3))
    with pytest.raises(ValueError, match="LossNorm.num_tokens must be an integer >= 0"):
        LossNorm(num_tokens=-1)


# Two sequences packed in one row, then padding: positions restart at 0 at each. Loss tokens 1-3
# (sequence 0) and 5-6 (sequence 1); trainer/generator ratios rho = exp(LOGP2 - GEN2) on them are
# e^0.2, 1, e^-1 (mean log -0.2667) and e^-0.1, e^0.3 (mean log 0.1).
POS2 = [0, 1, 2, 3, 0, 1, 2, 0]
MASK2 = [0, 1, 1, 1, 0, 1, 1, 0]
LOGP2 = [-0.1, -1.0, -0.5, -2.0, -0.3, -0.7, -1.2, -0.4]
GEN2 = [-0.1, -1.2, -0.5, -1.0, -0.3, -0.6, -1.5, -0.4]
ADV2 = [0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.0]
SEQS = [[1, 2, 3], [5, 6]]  # the loss tokens of each sequence
RHO = {t: math.exp(LOGP2[t] - GEN2[t]) for seq in SEQS for t in seq}


def run2(config, norm=LossNorm(num_tokens=5, num_sequences=2), logp=LOGP2, gen=GEN2, adv=ADV2, mask=MASK2,
         reference=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, stats = compute_loss(
        config, norm, logp, torch.tensor(mask), torch.tensor(adv, dtype=torch.float64),
        torch.tensor(gen, dtype=torch.float64), positions=torch.tensor(POS2),
        reference_logprobs=None if reference is None else torch.tensor(reference, dtype=torch.float64))
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats.metrics()


def reference_loss(per_token, logp=LOGP2, denominator=5.0):
    """Loss and gradient of a reference written from a paper's formula: `per_token(logp)` maps a
    differentiable logprob tensor to the summed loss."""
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    value = per_token(x) / denominator
    value.backward()
    return value.item(), x.grad.tolist()


def ppo(r, a, low, high):
    return -torch.minimum(r * a, r.clamp(1 - low, 1 + high) * a)


def test_gspo_clips_the_sequence_level_geometric_mean_ratio_and_averages_over_sequences():
    config = LossConfig(name="gspo", clip_low=0.05, clip_high=0.05)

    def gspo(x):  # GSPO, eq. (5)-(7): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), mean over sequences
        total = 0.0
        for seq in SEQS:
            s = torch.exp(sum(x[t] - GEN2[t] for t in seq) / len(seq))
            total = total + ppo(s, ADV2[seq[0]], 0.05, 0.05)
        return total

    expected, expected_grad = reference_loss(gspo, denominator=2.0)
    loss, grad, m = run2(config)
    # Sequence 0: s = e^-0.267 = 0.766 < 0.95 with A = 1: unclipped; sequence 1: s = 1.105 > 1.05 with A > 0: clipped.
    assert loss == pytest.approx(expected, abs=1e-12) and expected == pytest.approx((-math.exp(-0.8 / 3) - 0.525) / 2)
    assert grad == pytest.approx(expected_grad, abs=1e-12)
    assert grad[1] == pytest.approx(-math.exp(-0.8 / 3) / 3 / 2) and grad[5] == 0.0
    assert m["clip_fraction"] == pytest.approx(2 / 5)  # sequence 1's two tokens
    assert m["ratio/mean"] == pytest.approx((3 * math.exp(-0.8 / 3) + 2 * math.exp(0.1)) / 5)


def test_gspo_length_normalises_per_sequence_and_leaves_out_nonfinite_tokens():
    # Token 3's generator logprob is NaN: sequence 0 is tokens 1-2 only (|y| = 2, mean log ratio 0.1).
    gen = list(GEN2)
    gen[3] = NAN
    config = LossConfig(name="gspo", clip_low=0.5, clip_high=0.5)

    def gspo(x):
        total = 0.0
        for seq in ([1, 2], [5, 6]):
            s = torch.exp(sum(x[t] - gen[t] for t in seq) / len(seq))
            total = total + ppo(s, ADV2[seq[0]], 0.5, 0.5)
        return total

    expected, expected_grad = reference_loss(gspo, denominator=2.0)
    loss, grad, m = run2(config, LossNorm(num_tokens=4, num_sequences=2), gen=gen)
    assert loss == pytest.approx(expected, abs=1e-12) and grad == pytest.approx(expected_grad, abs=1e-12)
    assert grad[1] == pytest.approx(-math.exp(0.1) / 2 / 2) and grad[3] == 0.0
    assert grad[5] == pytest.approx(-0.5 * math.exp(0.1) / 2 / 2)
    assert m["tokens"] == 4 and m["nonfinite_logprob_tokens"] == 1


def test_cispo_weighs_reinforce_by_the_clipped_stop_gradient_ratio():
    # clip_low = 1: no lower bound, as CISPO runs; the upper bound clips e^0.2 and e^0.3 to 1.1.
    config = LossConfig(name="cispo", clip_low=1.0, clip_high=0.1)

    def cispo(x):  # MiniMax-M1, eq. (4): sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi, over all tokens
        return -sum(min(RHO[t], 1.1) * ADV2[t] * x[t] for seq in SEQS for t in seq)

    expected, expected_grad = reference_loss(cispo)
    loss, grad, m = run2(config)
    assert loss == pytest.approx(expected, abs=1e-12) and grad == pytest.approx(expected_grad, abs=1e-12)
    assert grad == pytest.approx([0, -1.1 / 5, -1 / 5, -math.exp(-1) / 5, 0, -0.5 * math.exp(-0.1) / 5,
                                  -0.5 * 1.1 / 5, 0], abs=1e-12)
    assert m["clip_fraction"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_zero_advantages_and_all_masked_tokens_give_zero_loss_and_gradient(name):
    config = LossConfig(name=name, clip_low=0.2, clip_high=0.2)
    loss, grad, m = run2(config, adv=[0.0] * 8)
    assert loss == 0.0 and grad == [0.0] * 8 and m["tokens"] == 5
    norm = LossNorm(num_tokens=1, num_sequences=1)
    loss, grad, m = run2(config, norm, mask=[0] * 8)
    assert loss == 0.0 and grad == [0.0] * 8 and m["tokens"] == 0 and m["is_ratio/p50"] == 0.0


def test_token_masked_is_drops_tokens_whose_ratio_leaves_the_range():
    # IcePop: with a correction on, the old policy is the trainer's own (r = 1): -A per kept token.
    config = LossConfig(name="grpo", is_mask_low=0.5, is_mask_high=1.2)
    kept = [t for t in RHO if 0.5 <= RHO[t] <= 1.2]
    assert kept == [2, 5]
    expected, expected_grad = reference_loss(lambda x: -sum(ADV2[t] * torch.exp(x[t] - x[t].detach()) for t in kept))
    loss, grad, m = run2(config)
    assert loss == pytest.approx(expected, abs=1e-12) and grad == pytest.approx(expected_grad, abs=1e-12)
    assert grad == pytest.approx([0, 0, -1 / 5, 0, 0, -0.5 / 5, 0, 0], abs=1e-12)
    assert m["is_masked/share"] == pytest.approx(3 / 5) and m["tokens"] == 5  # masked tokens stay counted


def test_masked_and_truncated_is_together_weigh_kept_tokens_by_their_ratio():
    # MIS: weight rho where rho <= C, else dropped (tis_cap = is_mask_high = C).
    config = LossConfig(name="grpo", tis_cap=1.25, is_mask_high=1.25)
    loss, grad, m = run2(config)
    kept = [t for t in RHO if RHO[t] <= 1.25]
    assert kept == [1, 2, 3, 5]
    assert loss == pytest.approx(-sum(RHO[t] * ADV2[t] for t in kept) / 5, abs=1e-12)
    assert grad == pytest.approx([-(RHO[t] * ADV2[t] if t in kept else 0) / 5 for t in range(8)], abs=1e-12)
    assert m["is_masked/share"] == pytest.approx(1 / 5) and m["is_truncated/share"] == pytest.approx(1 / 5)


def test_sequence_level_truncation_weighs_every_token_by_its_sequences_geometric_mean_ratio():
    config = LossConfig(name="grpo", tis_cap=1.05, tis_level="sequence")
    w = {0: math.exp(-0.8 / 3), 1: 1.05}  # e^0.1 = 1.105 truncated to 1.05
    loss, grad, m = run2(config)
    weights = [w[i] for i, seq in enumerate(SEQS) for _ in seq]
    advs = [ADV2[t] for seq in SEQS for t in seq]
    assert loss == pytest.approx(-sum(a * x for a, x in zip(advs, weights)) / 5, abs=1e-12)
    assert grad == pytest.approx([0, -w[0] / 5, -w[0] / 5, -w[0] / 5, 0, -0.5 * w[1] / 5, -0.5 * w[1] / 5, 0])
    assert m["is_truncated/share"] == pytest.approx(2 / 5)
    assert m["is_seq_ratio/max"] == pytest.approx(math.exp(0.1))
    # One count per sequence: the lower sequence is the median of two.
    assert m["is_seq_ratio/p50"] == pytest.approx(w[0], rel=1e-3)


def test_sequence_level_mask_drops_whole_sequences_and_all_masked_gives_zero():
    config = LossConfig(name="dapo", clip_high=0.28, is_mask_low=0.8, is_mask_high=1.2, is_mask_level="sequence")
    loss, grad, m = run2(config)  # sequence 0 (ratio 0.766) is dropped, sequence 1 (1.105) kept
    assert loss == pytest.approx(-0.5 * 2 / 5, abs=1e-12)
    assert grad == pytest.approx([0, 0, 0, 0, 0, -0.5 / 5, -0.5 / 5, 0], abs=1e-12)
    assert m["is_masked/share"] == pytest.approx(3 / 5)
    for level in ("token", "sequence"):
        none_kept = LossConfig(name="grpo", is_mask_low=1.0, is_mask_high=1.0, is_mask_level=level)
        loss, grad, m = run2(none_kept, gen=[x - 0.01 for x in LOGP2])  # every ratio is e^0.01
        assert loss == 0.0 and grad == [0.0] * 8 and m["is_masked/share"] == 1.0


def test_ratio_quantiles_and_max_over_the_steps_loss_tokens():
    _, _, m = run2(LossConfig(name="grpo"))
    # Sorted ratios: e^-1, e^-0.1, 1, e^0.2, e^0.3; p5 is the least, p50 the third, p95 the largest.
    for key, value in (("p5", math.exp(-1)), ("p50", 1.0), ("p95", math.exp(0.3))):
        assert math.log(m[f"is_ratio/{key}"]) == pytest.approx(math.log(value), rel=0.01, abs=1e-4), key
    assert m["is_ratio/max"] == pytest.approx(math.exp(0.3))
    assert "is_masked/share" not in m and "is_seq_ratio/p50" not in m


REF2 = [-0.2, -0.9, -0.6, -1.5, -0.3, -0.9, -1.0, -0.4]  # the reference policy's logprobs


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_the_reference_as_a_loss_term(estimator):
    config = LossConfig(name="grpo", kl_coef=0.1, kl_estimator=estimator)

    def kl(x, t):  # Schulman's estimators of KL(pi || pi_ref) on a sample of pi
        log_r = REF2[t] - x[t]
        return -log_r if estimator == "k1" else torch.exp(log_r) - 1 - log_r

    def grpo_with_kl(x):
        return sum(ppo(torch.exp(x[t] - GEN2[t]), ADV2[t], 0.2, 0.2) + 0.1 * kl(x, t) for seq in SEQS for t in seq)

    expected, expected_grad = reference_loss(grpo_with_kl)
    loss, grad, m = run2(config, reference=REF2)
    assert loss == pytest.approx(expected, abs=1e-12) and grad == pytest.approx(expected_grad, abs=1e-12)
    values = [float(kl(torch.tensor(LOGP2), t)) for seq in SEQS for t in seq]
    assert m["kl/mean"] == pytest.approx(sum(values) / 5)


def test_kl_to_the_reference_as_a_per_token_reward_penalty():
    config = LossConfig(name="grpo", tis_cap=2.0, kl_coef=0.1, kl_estimator="k1", kl_as="reward")
    # A_t - 0.1 (log pi - log pi_ref), no gradient through the penalty; TIS: r = 1, weight min(rho, 2).
    shaped = {t: ADV2[t] - 0.1 * (LOGP2[t] - REF2[t]) for seq in SEQS for t in seq}
    loss, grad, _ = run2(config, reference=REF2)
    assert loss == pytest.approx(-sum(RHO[t] * shaped[t] for t in shaped) / 5, abs=1e-12)
    assert grad == pytest.approx([-(RHO[t] * shaped[t] if t in shaped else 0) / 5 for t in range(8)], abs=1e-12)


def test_sequence_losses_do_not_depend_on_how_the_step_is_split_at_sequence_ends():
    config = LossConfig(name="gspo", clip_low=0.05, clip_high=0.05, tis_cap=1.05, tis_level="sequence")
    whole = run2(config)
    logp = torch.tensor(LOGP2, dtype=torch.float64, requires_grad=True)
    stats = LossStats()
    for part in (slice(0, 4), slice(4, 8)):
        value, s = compute_loss(config, LossNorm(num_tokens=5, num_sequences=2), logp[part],
                                torch.tensor(MASK2[part]), torch.tensor(ADV2[part], dtype=torch.float64),
                                torch.tensor(GEN2[part], dtype=torch.float64), positions=torch.tensor(POS2[part]))
        value.backward()
        stats = stats.merge(s)
    assert logp.grad.tolist() == pytest.approx(whole[1], abs=1e-15)
    assert stats.metrics() == pytest.approx(whole[2])


def test_sequence_losses_and_kl_refuse_missing_inputs():
    with pytest.raises(ValueError, match="needs the tokens' positions"):
        run(LossConfig(name="gspo"), LossNorm(num_tokens=3, num_sequences=1))
    with pytest.raises(ValueError, match="needs the tokens' positions"):
        run(LossConfig(name="grpo", tis_cap=2.0, tis_level="sequence"), LossNorm(num_tokens=3))
    with pytest.raises(ValueError, match="kl_coef > 0 needs the reference policy's logprobs"):
        run(LossConfig(name="grpo", kl_coef=0.1), LossNorm(num_tokens=3))
    with pytest.raises(ValueError, match="gspo needs LossNorm.num_sequences >= 1"):
        run2(LossConfig(name="gspo"), LossNorm(num_tokens=5))
    with pytest.raises(ValueError, match="reference_logprobs has shape"):
        run2(LossConfig(name="grpo", kl_coef=0.1), reference=[0.0])


def test_distillation_advantage_is_the_negated_reverse_kl_on_the_sampled_tokens_mixed_with_the_task():
    advantages, logp = torch.tensor([1.0, -1.0, 2.0, 5.0]), torch.tensor([-1.0, -0.5, -2.0, -0.3])
    teacher, used = torch.tensor([-0.5, -1.5, -2.0, -9.0]), torch.tensor([True, True, True, False])
    shaped, stats = distillation_advantages(0.5, 2.0, advantages, logp, teacher, used)
    # 0.5 A - 2 (log p - log p_teacher) on loss tokens; the last token is left as it is.
    assert shaped.tolist() == pytest.approx([0.5 - 2 * -0.5, -0.5 - 2 * 1.0, 1.0 - 0.0, 5.0])
    assert stats.metrics()["teacher_kl/mean"] == 0.0  # no "tokens" sum of its own: compute_loss gives it
    assert float(stats.sums["teacher_kl"]) == pytest.approx(-0.5 + 1.0 + 0.0)
    alone, _ = distillation_advantages(0.0, 1.0, advantages, logp, teacher, used)
    assert alone.tolist() == pytest.approx([0.5, -1.0, 0.0, 5.0])
