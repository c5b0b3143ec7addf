"""Off-policy correction: the loss, weighted for what rounding and staleness leave between the policy that
sampled a token (vLLM's, `behaviour_TOK`) and the one trained (`logp_TOK`).

TRL's loss already takes its ratio against vLLM's logprobs and clips it, PPO-style: the clip then mixes the
two kernels' rounding (bf16: ~1e-2 per token) and the samples' staleness into the trust region. Peers
correct with importance weights instead (verl, SkyRL, AReaL, NeMo-RL, slime, prime-rl, ROLL):

- `none`: TRL's loss, as is.
- `tis` (truncated importance sampling): each token's policy gradient weighted by
  w = min(pi_train / pi_vllm, cap), with no clip: loss = -w * A * exp(logp - logp.detach()).
- `icepop`: TRL's loss, with the tokens whose pi_train / pi_vllm leaves `band` masked out (a token the two
  kernels disagree on that much teaches nothing reliable).

A token whose vLLM logprob is -inf or NaN (vLLM sampled what it rates impossible: a kernel fault) is
masked and counted under every method but `none`, whose loss stays TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_cluster.trainer.compat import train_metrics

METHODS = ("none", "tis", "icepop")


def corrected_loss_TOK(logp_TOK: torch.Tensor, behaviour_TOK: torch.Tensor, advantages_TOK: torch.Tensor, *,
                       method: str, cap: float, band: tuple[float, float], eps_low: float,
                       eps_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Per-token loss (summed and normalised by the caller, as TRL does) and the step's statistics:
    `ratio_sum`, `ratio_max` and `finite` over tokens with a finite vLLM logprob, `corrected` (truncated or
    masked by the method), `nonfinite`, `tokens`."""
    if method not in METHODS:
        raise ValueError(f"unknown correction {method!r}: one of {', '.join(METHODS)}")
    finite_TOK = torch.isfinite(behaviour_TOK)
    detached_TOK = logp_TOK.detach()
    # Non-finite behaviour logprobs are replaced before any arithmetic: a NaN in a masked branch would
    # still reach the gradient through exp's backward.
    behaviour_TOK = torch.where(finite_TOK, behaviour_TOK, detached_TOK)
    ratio_TOK = torch.exp(detached_TOK - behaviour_TOK)  # pi_train / pi_vllm, per token
    if method == "tis":
        weight_TOK = ratio_TOK.clamp(max=cap)
        loss_TOK = -weight_TOK * advantages_TOK * torch.exp(logp_TOK - detached_TOK)
        corrected_TOK = finite_TOK & (ratio_TOK > cap)
        keep_TOK = finite_TOK
    else:
        coef_1 = torch.exp(logp_TOK - behaviour_TOK)
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        loss_TOK = -torch.min(coef_1 * advantages_TOK, coef_2 * advantages_TOK)
        corrected_TOK = torch.zeros_like(finite_TOK)
        keep_TOK = finite_TOK
        if method == "icepop":
            inside_TOK = (ratio_TOK >= band[0]) & (ratio_TOK <= band[1])
            corrected_TOK = finite_TOK & ~inside_TOK
            keep_TOK = finite_TOK & inside_TOK
    loss_TOK = torch.where(keep_TOK, loss_TOK, torch.zeros_like(loss_TOK))
    finite_ratio_TOK = torch.where(finite_TOK, ratio_TOK, torch.zeros_like(ratio_TOK))
    stats = {
        "ratio_sum": finite_ratio_TOK.sum(),
        "ratio_max": finite_ratio_TOK.max() if finite_ratio_TOK.numel() else torch.zeros(()),
        "finite": finite_TOK.sum().to(ratio_TOK.dtype),
        "corrected": corrected_TOK.sum().to(ratio_TOK.dtype),
        "nonfinite": (~finite_TOK).sum().to(ratio_TOK.dtype),
        "tokens": torch.tensor(float(ratio_TOK.numel()), dtype=ratio_TOK.dtype, device=ratio_TOK.device),
    }
    return loss_TOK, stats


@dataclass(frozen=True)
class OffPolicyCorrection:
    """`trainer.correction` over TRL's compute_loss: TRL computes its loss and every metric of its own on
    the true ratio; under `tis` and `icepop` the loss returned is ours, over the same forward (compat item
    21). The step's statistics go beside TRL's metrics under `correction/`."""

    method: str = "none"
    cap: float = 2.0
    band: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown correction {self.method!r}: one of {', '.join(METHODS)}")

    def loss(self, trainer, outputs, inputs, trl_loss: torch.Tensor) -> torch.Tensor:
        """The loss to train on: TRL's (`trl_loss`, from the forward that gave `outputs`) under `none`,
        ours otherwise, normalised as TRL normalises its own."""
        selected = inputs["token_index"] >= 0
        logp_TOK = outputs.log_probs.flatten()[inputs["token_index"][selected]]
        ours_TOK, stats = corrected_loss_TOK(
            logp_TOK, inputs["old_log_probs"][selected], inputs["advantages"][selected],
            method=self.method, cap=self.cap, band=self.band,
            eps_low=trainer.epsilon_low, eps_high=trainer.epsilon_high,
        )  # fmt: skip
        _log_stats(trainer, stats)
        if self.method == "none":
            return trl_loss
        # TRL's normalisation: by this rank's share of the batch's tokens, and by gradient accumulation.
        accumulation = trainer.current_gradient_accumulation_steps
        tokens_per_rank = (inputs["global_n_tokens"][0] / trainer.accelerator.num_processes).clamp(min=1.0)
        ours = ours_TOK.sum() / tokens_per_rank.to(torch.float32) / accumulation
        if trainer.aux_loss_enabled:
            ours = ours + trainer.router_aux_loss_coef * outputs.aux_loss / accumulation
        return ours


@torch.no_grad()
def _log_stats(trainer, stats: dict[str, torch.Tensor]) -> None:
    sums = torch.stack([stats[k] for k in ("ratio_sum", "finite", "corrected", "nonfinite", "tokens")])
    ratio_sum, finite, corrected, nonfinite, tokens = trainer.accelerator.reduce(
        sums, reduction="sum"
    ).tolist()
    ratio_max = trainer.accelerator.gather(stats["ratio_max"].reshape(1)).max().item()
    metrics = train_metrics(trainer)
    # TRL's reductions by shape and name: pairs are rates, `max` an extremum, `total` a counter.
    metrics["correction/ratio_mean"].append((ratio_sum, finite))
    metrics["correction/ratio_max"].append(ratio_max)
    metrics["correction/share_corrected"].append((corrected, tokens))
    metrics["correction/nonfinite_total"].append(nonfinite)
