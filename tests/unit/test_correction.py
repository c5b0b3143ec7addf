"""The off-policy correction's per-token loss (rl_cluster.trainer.correction): what each method weights,
truncates and masks, by the gradient each token gets."""

import math

import pytest
import torch

from rl_cluster.trainer.correction import corrected_loss_TOK

KW = {"cap": 2.0, "band": (0.5, 5.0), "eps_low": 0.2, "eps_high": 0.2}
# pi_train / pi_vllm per token: on-policy, a little above, above the cap, below the band, above the band.
RATIO = torch.tensor([1.0, 1.5, 3.0, 0.25, 8.0], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0, 1.0, 2.0, -0.5], dtype=torch.float64)


def grads(method: str, behaviour=None, advantages=ADV):
    logp = torch.full((len(RATIO),), -1.0, dtype=torch.float64, requires_grad=True)
    if behaviour is None:
        behaviour = logp.detach() - torch.log(RATIO)
    loss, stats = corrected_loss_TOK(logp, behaviour, advantages, method=method, **KW)
    loss.sum().backward()
    return logp.grad, loss.detach(), stats


def test_tis_weights_each_tokens_gradient_by_its_ratio_truncated_at_the_cap_without_clipping():
    grad, _, stats = grads("tis")
    expected = -ADV * RATIO.clamp(max=2.0)
    torch.testing.assert_close(grad, expected)
    assert stats["corrected"].item() == 2  # 3.0 and 8.0 truncated to 2
    assert stats["ratio_max"].item() == pytest.approx(8.0) and stats["ratio_sum"].item() == pytest.approx(
        13.75
    )


def test_none_is_trls_clipped_loss_and_icepop_masks_what_leaves_the_band():
    grad_none, loss_none, stats = grads("none")
    # TRL's PPO loss: -min(r A, clip(r) A); the gradient is r A where the clip does not bind, else 0.
    r = RATIO
    clipped = ((r > 1.2) & (ADV > 0)) | ((r < 0.8) & (ADV < 0))
    torch.testing.assert_close(grad_none, torch.where(clipped, 0.0, -r * ADV).to(torch.float64))
    torch.testing.assert_close(loss_none, -torch.min(r * ADV, r.clamp(0.8, 1.2) * ADV))
    assert stats["corrected"].item() == 0
    grad_ice, _, stats = grads("icepop")
    outside = (RATIO < 0.5) | (RATIO > 5.0)
    torch.testing.assert_close(grad_ice, torch.where(outside, 0.0, grad_none))
    assert stats["corrected"].item() == 2


@pytest.mark.parametrize("method", ["tis", "icepop"])
def test_tokens_whose_vllm_logprob_is_not_finite_are_masked_and_counted(method):
    behaviour = torch.tensor([-1.0, -math.inf, math.nan, -1.0, -1.0], dtype=torch.float64)
    grad, loss, stats = grads(method, behaviour)
    assert torch.isfinite(grad).all() and torch.isfinite(loss).all()
    assert grad[1] == 0 and grad[2] == 0 and grad[0] != 0
    assert stats["nonfinite"].item() == 2 and stats["finite"].item() == 3
    assert stats["ratio_sum"].item() == pytest.approx(3.0)  # only finite tokens, each on-policy here


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown correction 'ppo'"):
        grads("ppo")
