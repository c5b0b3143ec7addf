"""The served-vs-trained verdict on per-token logprobs: rounding is no mismatch in any dtype, a wrong
adapter is one, and versions closer than the rounding lets the check see are 'too close to tell'."""

import dataclasses
import math
import random

import pytest

from rl_cluster.core.served_check import (
    Verdict,
    judge,
    mean_abs_diff,
    mismatch_banner,
    sync_verdict,
)

rng = random.Random(0)
EXACT = [-rng.uniform(0.1, 4.0) for _ in range(200)]


def noisy(values, scale, seed):
    r = random.Random(seed)
    return [v + r.gauss(0, scale) for v in values]


def shifted(values, by):
    return [v + by * (1 if i % 2 else -1) for i, v in enumerate(values)]


@pytest.mark.parametrize("rounding", [3e-7, 1e-2])  # fp32 against fp64, bf16 against fp32 (measured)
def test_a_replica_serving_the_trained_adapter_matches_in_either_dtype(rounding):
    served, rounded = noisy(EXACT, rounding, 1), noisy(EXACT, rounding, 2)
    check = judge("g0", served, noisy(EXACT, rounding, 3), EXACT, rounded, {"base": shifted(EXACT, 0.5)}, 4.0)
    assert check.verdict is Verdict.MATCH, check
    assert check.distance / check.floor < 2 and check.tokens == 200
    assert check.separations["base"] == pytest.approx(0.5)


@pytest.mark.parametrize("rounding", [3e-7, 1e-2])
def test_a_replica_serving_the_base_model_or_an_older_version_is_a_mismatch(rounding):
    base, older = shifted(EXACT, 0.5), shifted(EXACT, 0.2)
    for wrong in (base, older):
        served = noisy(wrong, rounding, 4)
        check = judge("g1", served, EXACT, EXACT, noisy(EXACT, rounding, 5), {"base": base, "v3": older}, 4.0)
        assert check.verdict is Verdict.MISMATCH, check
    banner = mismatch_banner("run-v7", check, "bfloat16")
    assert "g1 does not serve run-v7" in banner and "It matches the v3" in banner


def test_in_fp32_another_kernels_rounding_a_few_floors_off_is_no_mismatch():
    """Measured in a chaos run: vLLM's fp32 served the right adapter at 9.9e-7 per token from the exact
    logprobs, 5.3 of the trainer's own floors (1.9e-7): a check judges against at least MIN_FLOOR per
    token. A wrong adapter, even one 0.03 per token off, is still a mismatch."""
    rounded = noisy(EXACT, 2.4e-7, 8)  # a floor of ~1.9e-7, as the trainer measured it
    served = noisy(EXACT, 1.24e-6, 9)  # ~9.9e-7 per token from the exact logprobs
    check = judge("g0", served, EXACT, EXACT, rounded, {"base": shifted(EXACT, 0.5)}, 4.0)
    assert check.distance / check.floor > 4  # beyond 4 floors: a mismatch against the floor alone
    assert check.verdict is Verdict.MATCH, check
    older = shifted(EXACT, 0.03)
    check = judge("g0", noisy(older, 1.24e-6, 9), EXACT, EXACT, rounded, {"v1": older}, 4.0)
    assert check.verdict is Verdict.MISMATCH, check


def test_versions_closer_than_the_rounding_floor_are_too_close_to_tell():
    rounding = 1e-2
    older = shifted(EXACT, 0.03)  # < 2 x 4 floors of ~8e-3 each
    check = judge("g0", noisy(EXACT, rounding, 6), EXACT, EXACT, noisy(EXACT, rounding, 7),
                  {"base": shifted(EXACT, 0.5), "v1": older}, 4.0)  # fmt: skip
    assert check.verdict is Verdict.UNDECIDED and check.too_close == ["v1"]
    # The same versions are told apart in fp32, whose floor is 10,000 times lower.
    check = judge("g0", noisy(EXACT, 3e-7, 6), EXACT, EXACT, noisy(EXACT, 3e-7, 7), {"v1": older}, 4.0)
    assert check.verdict is Verdict.MATCH


def test_a_floor_of_zero_still_allows_one_fp32_ulp_and_no_finite_token_is_no_match():
    check = judge("g0", noisy(EXACT, 1e-8, 1), EXACT, EXACT, list(EXACT), {}, 4.0)
    assert check.floor == 0 and check.verdict is Verdict.MATCH
    inf = [-math.inf] * 3
    assert judge("g0", inf, inf, [-1.0] * 3, [-1.0] * 3, {}, 4.0).verdict is Verdict.MISMATCH


def test_non_finite_tokens_are_left_out_and_lengths_must_agree():
    assert mean_abs_diff([-1.0, -math.inf], [-1.5, -2.0]) == 0.5
    with pytest.raises(ValueError, match="different lengths"):
        mean_abs_diff([1.0], [1.0, 2.0])


def test_a_syncs_verdict_is_its_worst_replicas():
    def one(verdict_served):
        return judge(
            "g", verdict_served, EXACT, EXACT, noisy(EXACT, 1e-2, 9), {"base": shifted(EXACT, 0.5)}, 4.0
        )

    match, mismatch = one(noisy(EXACT, 1e-2, 8)), one(shifted(EXACT, 0.5))
    assert sync_verdict([match, mismatch]) is Verdict.MISMATCH
    assert sync_verdict([match]) is Verdict.MATCH and sync_verdict([]) is None


def test_checks_run_until_one_tells_and_the_older_reference_moves_only_when_told_apart(monkeypatch):
    """v1 is the base model (too close to tell): the next syncs are checked too, until one tells. The
    older version compared with stays the last one told apart, so small steps in bf16 are not each
    'too close' to the version just before."""
    from rl_cluster.config import RunConfig
    from rl_cluster.trainer import check as check_module

    verdicts = iter([Verdict.UNDECIDED, Verdict.UNDECIDED, Verdict.MATCH, Verdict.UNDECIDED, Verdict.MATCH])
    olders = []

    def fake_judged(model, answers, prompt_ids, dtype, noise_multiple, older):
        olders.append(older[0] if older else None)
        base = judge("g0", EXACT, EXACT, EXACT, noisy(EXACT, 1e-2, 1), {}, 4.0)
        return [dataclasses.replace(base, verdict=next(verdicts))]

    asked = []
    monkeypatch.setattr(check_module, "replica_answers", lambda urls, adapter, *a, **kw: asked.append(adapter) or
                        [(urls[0], [{"token_ids": [3], "logprobs": [-1.0]}])])  # fmt: skip
    monkeypatch.setattr(check_module, "judged", fake_judged)
    monkeypatch.setattr(check_module, "lora_state", lambda model: {})
    config = RunConfig.model_validate({"run_name": "r", "check": {"every_syncs": 3}})
    served = check_module.ServedCheck(config)
    for version in range(1, 8):
        served.run(None, version, lambda: ["http://g0"], f"r-v{version}", [1])
    done = [int(adapter.rsplit("-v", 1)[1]) for adapter in asked]
    assert done == [1, 2, 3, 6]  # until v3 told; then every 3rd sync
    # v1 held as the first reference; v2 too close to it (kept); v3 told apart (becomes it); v6 too close.
    assert olders == [None, "v1", "v1", "v3"]
    assert served.older[0] == "v3"
