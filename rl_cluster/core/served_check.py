"""Served = trained, the judgement: is what a replica serves the adapter the trainer trained, in any dtype?

vLLM and the trainer compute one policy in two sets of kernels. In fp32 their logprobs agree to ~1e-7 per
token; in bf16 they differ by ~1e-3 to 1e-2 even when the adapter is right (rounding, not a wrong adapter),
which is more than two nearby versions differ by. A fixed tolerance is therefore wrong in one dtype or the
other, so the check measures the rounding floor on the very tokens it judges:

- `exact_TOK`: the trainer's logprobs of the trained adapter computed one precision up (fp32 for a bf16 or
  fp16 model, fp64 for fp32) on the same stored weights: the policy itself, free of rounding;
- `rounded_TOK`: the same computed in the model's dtype with the LoRA rounded to it, as vLLM serves it;
- floor = mean |rounded - exact|: how far one dtype computation of the right policy lands from it.

The served logprobs are judged by their mean distance to the exact ones: within `noise_multiple` floors
they are the trained adapter's (`MATCH`), beyond it they are not (`MISMATCH`: the run fails). What they are
told apart from is what the check also computes exactly: the base model (the adapter not applied) and an
older version. When one of those lies within twice the bound of the trained adapter, a replica serving it
would pass too: the check cannot tell (`UNDECIDED`, counted, never a failure).

Per token arrays are flat lists (one entry per completion token of the sampled completions). No torch,
Ray, vLLM or HTTP here: rl_cluster.trainer.check samples and computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Verdict(StrEnum):
    MATCH = "match"
    """The replica serves the trained adapter, told apart from every alternative computed."""
    UNDECIDED = "too_close"
    """Within the bound of the trained adapter, but so is an alternative: the check cannot tell them apart."""
    MISMATCH = "mismatch"
    """The served logprobs are further from the trained adapter's than rounding explains."""


# Worst first: a sync's verdict is its worst replica's.
SEVERITY = (Verdict.MISMATCH, Verdict.UNDECIDED, Verdict.MATCH)


def mean_abs_diff(a_TOK: Sequence[float], b_TOK: Sequence[float]) -> float:
    """Mean absolute difference of two per-token arrays of one length; tokens where either is not finite
    (vLLM's -inf for a token it would never sample) are left out. NaN when none is left.

    >>> mean_abs_diff([0.0, -1.0, float("-inf")], [0.5, -1.0, -2.0])
    0.25
    """
    if len(a_TOK) != len(b_TOK):
        raise ValueError(f"per-token arrays of different lengths: {len(a_TOK)} and {len(b_TOK)}")
    diffs = [abs(a - b) for a, b in zip(a_TOK, b_TOK, strict=True) if math.isfinite(a) and math.isfinite(b)]
    return sum(diffs) / len(diffs) if diffs else math.nan


def _too_close(separations: dict[str, float], bound: float) -> list[str]:
    """Alternatives within twice the bound of the trained adapter: a replica serving one would pass too."""
    return [name for name, sep in separations.items() if not sep > 2 * bound]


@dataclass(frozen=True)
class ReplicaCheck:
    """One replica's samples judged. Distances are mean |difference| of logprobs per token (nats)."""

    replica: str
    tokens: int
    verdict: Verdict
    gap: float
    """Served vs the trainer's logprobs as it trains (the importance ratio's log, on average)."""
    distance: float
    """Served vs the trained adapter computed exactly."""
    floor: float
    """The model's dtype's rounding of the trained adapter, measured on these tokens."""
    bound: float
    """`noise_multiple` floors: the largest distance a serving of the trained adapter is allowed."""
    separations: dict[str, float] = field(default_factory=dict)
    """Per alternative (`base`, `v7`, ...): its exact distance from the trained adapter."""
    served_from: dict[str, float] = field(default_factory=dict)
    """Per alternative: the served logprobs' distance from it (which one a mismatch looks like)."""

    @property
    def too_close(self) -> list[str]:
        """Alternatives the check cannot tell from the trained adapter on these tokens."""
        return _too_close(self.separations, self.bound)

    def as_dict(self) -> dict:
        return {
            "replica": self.replica,
            "tokens": self.tokens,
            "verdict": self.verdict.value,
            "gap": self.gap,
            "distance": self.distance,
            "floor": self.floor,
            "bound": self.bound,
            "separations": dict(self.separations),
            "served_from": dict(self.served_from),
        }


# The least floor a check judges against, per token. The floor is the trainer's own rounding, but the
# served side rounds in kernels of its own: in fp32 (floors of ~1e-7) vLLM's CPU kernels, with another
# thread count, served the right adapter at 1.7 to 5.3 floors of the trainer's, at most 9.9e-7 per token,
# in 42 checks of one chaos run (the 5.3 failed a run that served the right adapter, 0.48 per token from
# any alternative). A bf16 floor (~1e-2) is far above this; two fp32 versions are ~1e-2 apart.
MIN_FLOOR = 5e-7


def judge(
    replica: str,
    served_TOK: Sequence[float],
    trained_TOK: Sequence[float],
    exact_TOK: Sequence[float],
    rounded_TOK: Sequence[float],
    alternatives: dict[str, Sequence[float]],
    noise_multiple: float,
) -> ReplicaCheck:
    """The verdict on one replica's tokens. `trained_TOK`: the trainer's logprobs as it trains;
    `alternatives`: exact logprobs of what a wrong replica might serve instead, by name."""
    floor = mean_abs_diff(rounded_TOK, exact_TOK)
    bound = noise_multiple * max(floor, MIN_FLOOR)
    distance = mean_abs_diff(served_TOK, exact_TOK)
    separations = {name: mean_abs_diff(alt, exact_TOK) for name, alt in alternatives.items()}
    served_from = {name: mean_abs_diff(served_TOK, alt) for name, alt in alternatives.items()}
    if not distance <= bound:  # NaN (no finite token) is no match either
        verdict = Verdict.MISMATCH
    elif _too_close(separations, bound):
        verdict = Verdict.UNDECIDED
    else:
        verdict = Verdict.MATCH
    return ReplicaCheck(
        replica=replica,
        tokens=len(served_TOK),
        verdict=verdict,
        gap=mean_abs_diff(served_TOK, trained_TOK),
        distance=distance,
        floor=floor,
        bound=bound,
        separations=separations,
        served_from=served_from,
    )


def sync_verdict(checks: Sequence[ReplicaCheck]) -> Verdict | None:
    """The worst replica's verdict; None when no replica answered."""
    found = {c.verdict for c in checks}
    return next((v for v in SEVERITY if v in found), None)


def mismatch_banner(adapter: str, check: ReplicaCheck, dtype: str) -> str:
    """What was found, in words: how far the served logprobs are from the trained adapter's, against
    the rounding floor, and which alternative (if any) they are closest to."""
    line = (
        f"SERVED != TRAINED: {check.replica} does not serve {adapter} as trained: its logprobs are "
        f"{check.distance:.2e} per token from the trained adapter's, {check.distance / check.bound:.0f}x the "
        f"bound ({check.bound:.1e}: {dtype} rounding measures {check.floor:.1e} on the same "
        f"{check.tokens} tokens)."
    )
    if check.served_from:
        name, dist = min(check.served_from.items(), key=lambda kv: kv[1])
        like = "matches" if dist <= check.bound else "is closest to"
        line += f" It {like} the {'base model' if name == 'base' else name} ({dist:.2e} per token)."
    return line


def undecided_line(adapter: str, check: ReplicaCheck) -> str:
    close = ", ".join(
        f"{'base model' if n == 'base' else n} {check.separations[n]:.1e}" for n in check.too_close
    )
    return (
        f"served-vs-trained check of {adapter} on {check.replica}: too close to tell: served is "
        f"{check.distance:.1e} per token from the trained adapter (bound {check.bound:.1e}), but what it is told "
        f"apart from is within reach too ({close} from it; more than {2 * check.bound:.1e} is needed)"
    )
