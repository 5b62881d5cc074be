"""The algorithm's public functions against hand-computed values and their defining properties."""

import math

import pytest
import torch

from trainer.grpo import clipped_objective, group_advantages, perturb_noise
from trainer.neighbor_grpo import leaping_log_probs, policy_temperature, reference_penalty


# -- perturb_noise -------------------------------------------------------------------------
def test_perturb_noise_formula_and_shape():
    base = torch.randn(3, 4, 4)
    gen = torch.Generator().manual_seed(7)
    out = perturb_noise(base, 5, 0.3, generator=gen)
    assert out.shape == (5, 3, 4, 4)
    delta = torch.randn((5, 3, 4, 4), generator=torch.Generator().manual_seed(7))
    expected = math.sqrt(1 - 0.09) * base + 0.3 * delta
    torch.testing.assert_close(out, expected)


def test_perturb_noise_endpoints():
    base = torch.randn(8)
    assert torch.equal(perturb_noise(base, 4, 0.0), base.expand(4, 8))
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    torch.testing.assert_close(perturb_noise(base, 4, 1.0, gen_a), torch.randn((4, 8), generator=gen_b))


@pytest.mark.parametrize("sigma", [-0.01, 1.01, 2.0])
def test_perturb_noise_rejects_sigma_outside_unit_interval(sigma):
    with pytest.raises(ValueError, match="sigma"):
        perturb_noise(torch.zeros(3), 2, sigma)


@pytest.mark.parametrize("sigma", [0.1, 0.3, 0.7])
def test_perturbed_noise_keeps_unit_variance(sigma):
    gen = torch.Generator().manual_seed(0)
    samples = torch.stack([perturb_noise(torch.randn(64, generator=gen), 16, sigma, gen)
                           for _ in range(200)])  # (200, 16, 64)
    assert abs(samples.var().item() - 1.0) < 0.02
    assert abs(samples.mean().item()) < 0.02
    # members of one group are correlated by 1 - sigma^2
    a, b = samples[:, 0].flatten(), samples[:, 1].flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr - (1 - sigma**2)) < 0.03


# -- group_advantages -----------------------------------------------------------------------
def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # mean 3, population std sqrt((4+1+0+9)/4) = sqrt(3.5)
    expected = (rewards - 3.0) / (math.sqrt(3.5) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards), expected)


def test_p2_equals_plain_zscore_batched():
    rewards = torch.rand(5, 12)
    z = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, unbiased=False, keepdim=True) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, p=2.0), z)
    # the quasi-norm formula itself at p=2 is the identity on a z-score (||z||_2 = sqrt(G))
    norm = z.pow(2).sum(-1, keepdim=True).sqrt()
    torch.testing.assert_close(math.sqrt(12) * z / norm, z, atol=1e-3, rtol=1e-3)


def test_quasi_norm_hand_computed():
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0])
    z = group_advantages(rewards)
    p = 0.8
    expected = 2.0 * z / z.abs().pow(p).sum().pow(1 / p)
    torch.testing.assert_close(group_advantages(rewards, p=p), expected)


def test_p_below_2_keeps_sign_and_order_and_shrinks_flat_groups_more():
    flat = torch.tensor([0.0, 1.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6, 0.45, 0.55])
    sparse = torch.tensor([0.0] * 11 + [1.0])
    for rewards in (flat, sparse):
        a2, a08 = group_advantages(rewards), group_advantages(rewards, p=0.8)
        assert torch.equal(torch.sign(a2), torch.sign(a08))
        assert torch.equal(torch.argsort(a2), torch.argsort(a08))
    shrink_flat = group_advantages(flat, p=0.8).abs().sum() / group_advantages(flat).abs().sum()
    shrink_sparse = group_advantages(sparse, p=0.8).abs().sum() / group_advantages(sparse).abs().sum()
    assert shrink_flat < shrink_sparse < 1.0


def test_equal_rewards_give_zeros_not_nan():
    for p in (2.0, 0.8):
        out = group_advantages(torch.full((3, 6), 0.7), p=p)
        assert torch.equal(out, torch.zeros(3, 6))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_raise(bad):
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(torch.tensor([0.1, bad, 0.3]))


# -- leaping_log_probs ----------------------------------------------------------------------
def test_leaping_log_probs_hand_computed():
    candidates = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    anchor = torch.tensor([0.0, 0.0])
    # squared distances 0, 1, 4; temperature 2 -> logits 0, -0.5, -2
    logits = torch.tensor([0.0, -0.5, -2.0])
    expected = logits - torch.logsumexp(logits, 0)
    torch.testing.assert_close(leaping_log_probs(candidates, anchor, temperature=2.0), expected)


def test_leaping_log_probs_batched_anchors_and_dtype():
    candidates = torch.randn(6, 3, 4, 4, dtype=torch.bfloat16)
    anchors = torch.randn(5, 3, 4, 4, dtype=torch.bfloat16)
    out = leaping_log_probs(candidates, anchors, temperature=48.0)
    assert out.shape == (5, 6) and out.dtype == torch.float32
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(out[2], leaping_log_probs(candidates, anchors[2], temperature=48.0))


def test_leaping_log_probs_stable_for_large_distances():
    candidates = torch.randn(12, 3072) * 10  # squared distances ~ 6e5: softmax outside log space overflows
    out = leaping_log_probs(candidates, candidates[3] + 0.01)
    assert torch.isfinite(out).all()
    assert out.argmax().item() == 3


# -- clipped_objective ----------------------------------------------------------------------
def test_clipped_objective_hand_computed():
    logp_old = torch.zeros(4)
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.95])
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    # clip 0.2: min(A r, A clip(r)) = [1.2, 0.5, -1.1, -1.9] -> loss = -mean
    loss = clipped_objective(torch.log(ratios), logp_old, adv, 0.2)
    torch.testing.assert_close(loss, -torch.tensor([1.2, 0.5, -1.1, -1.9]).mean())


def test_ratio_is_exactly_one_before_the_first_update():
    logp = leaping_log_probs(torch.randn(12, 3, 8, 8), torch.randn(3, 8, 8), 192.0)
    adv = group_advantages(torch.rand(12))
    assert torch.equal(torch.exp(logp - logp), torch.ones(12))
    torch.testing.assert_close(clipped_objective(logp, logp.clone(), adv, 0.2), -adv.mean())


def test_gradient_moves_prediction_toward_positive_and_away_from_negative_candidate():
    candidates = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0, 0.0])
    x = torch.zeros(2, requires_grad=True)
    logp_old = leaping_log_probs(candidates, x.detach(), 1.0)
    for _ in range(20):  # plain gradient descent on the loss
        loss = clipped_objective(leaping_log_probs(candidates, x, 1.0), logp_old, advantages, 10.0)
        (grad,) = torch.autograd.grad(loss, x)
        with torch.no_grad():
            x -= 0.05 * grad
    dist = (candidates - x.detach()).norm(dim=-1)
    assert dist[0] < 1.0 - 0.1  # closer to the positive candidate than at the start
    assert dist[1] > 1.0 + 0.1  # farther from the negative one


@pytest.mark.parametrize("temperature", [1.0, 50.0, 3072.0])
def test_first_step_gradient_is_the_advantage_weighted_sum_of_the_candidates(temperature):
    # At ratio 1 the loss's gradient on the prediction is -(2 / (G T)) sum_i A_i x_i (the A_i
    # sum to 0): every anchor of a group is pulled along one linear combination of the group's
    # latents, whatever the temperature, which only scales it. docs/benchmarks.md shows what
    # this means for an attribute such as object size.
    candidates = torch.randn(12, 3, 8, 8, dtype=torch.float64)
    advantages = group_advantages(torch.rand(12)).double()
    x = torch.randn(3, 8, 8, dtype=torch.float64, requires_grad=True)
    logp_old = leaping_log_probs(candidates, x.detach(), temperature)
    loss = clipped_objective(leaping_log_probs(candidates, x, temperature), logp_old, advantages, 0.2)
    (grad,) = torch.autograd.grad(loss, x)
    expected = -(2.0 / (12 * temperature)) * (advantages.view(12, 1, 1, 1) * candidates).sum(0)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)  # float32 inside


# -- reference_penalty -----------------------------------------------------------------------
def test_reference_penalty_hand_computed_and_zero_at_the_reference():
    prediction = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    reference = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    # squared distances 1 and 4, mean 2.5, over temperature 2
    assert reference_penalty(prediction, reference, 2.0).item() == pytest.approx(1.25)
    assert reference_penalty(prediction, prediction.clone(), 2.0).item() == 0.0


def test_reference_penalty_gradient_pulls_the_prediction_back():
    x = torch.tensor([[3.0, -1.0]], requires_grad=True)
    reference_penalty(x, torch.zeros(1, 2), 1.0).backward()
    assert torch.allclose(x.grad, 2 * x.detach())  # d/dx ||x||^2


def test_the_default_temperature_keeps_the_policy_alike_at_flux_latent_size():
    """temperature 0 (default) means the flattened latent dimension: the logits are then mean
    squared differences per element, so a one-step prediction near one of 12 neighbours
    (sigma 0.3) gets the same spread of probabilities for the shapes model's 3x32x32 latents
    and FLUX's 512 px packed latents (1,024 tokens x 64 = 64x64x16), instead of a one-hot
    policy whose ratios would be all or nothing."""
    def probabilities(shape: tuple[int, ...], temperature: float = 0.0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        candidates = perturb_noise(torch.randn(shape, generator=gen), 12, 0.3, generator=gen)
        prediction = candidates[0] + 0.05 * torch.randn(shape, generator=gen)
        # what update_policy uses, from the flattened candidates it holds
        used = policy_temperature(temperature, candidates.flatten(1).shape[-1])
        return leaping_log_probs(candidates, prediction, used).exp()

    shapes, flux = probabilities((3, 32, 32)), probabilities((1024, 64))
    for p in (shapes, flux):
        assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
        assert 1 / 12 < float(p[0]) < 0.2  # the near neighbour ahead, the rest not zero
    assert float(flux[0]) == pytest.approx(float(shapes[0]), abs=0.01)
    # a fixed temperature of 1 at FLUX's size: every probability but one underflows
    assert float(probabilities((1024, 64), temperature=1.0)[0]) > 0.999
