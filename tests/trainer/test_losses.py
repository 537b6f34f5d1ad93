"""Each loss against hand-computed values on small tensors (loss, gradient, metrics)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlactors.config import LossConfig
from rlactors.trainer.losses import LossNorm, LossStats, compute_loss

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
