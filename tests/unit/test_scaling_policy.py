"""The elastic pool's decisions (rl_cluster.core.scaling) and the config bounds that feed them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rl_cluster.config import load_config
from rl_cluster.core.scaling import Decision, PoolSnapshot, ReplicaLoad, ScalingPolicy, ScalingRules

RULES = ScalingRules(min_replicas=1, max_replicas=3, up_in_flight=4, up_window_s=10, down_window_s=30,
                     cooldown_s=20)  # fmt: skip


def snap(t: float, *loads: tuple[int, int], starting: int = 0, unavailable: int = 0, queued: int = 0):
    """Replicas g0, g1, ... with (in_flight, requests routed so far)."""
    serving = {f"g{i}": ReplicaLoad(in_flight, requests) for i, (in_flight, requests) in enumerate(loads)}
    return PoolSnapshot(t, serving, starting=starting, unavailable=unavailable, queued=queued)


def run(policy: ScalingPolicy, samples) -> list[tuple[float, Decision]]:
    return [(s.time, d) for s in samples if (d := policy.observe(s)) is not None]


def test_grows_only_after_demand_stayed_high_for_the_whole_window():
    policy = ScalingPolicy(RULES)
    # 6 in flight on one replica (> 4) from t=0; a dip at t=6 restarts the window.
    samples = (
        [snap(t, (6, t)) for t in range(0, 6)] + [snap(6, (3, 6))] + [snap(t, (6, t)) for t in range(7, 20)]
    )
    decisions = run(policy, samples)
    assert len(decisions) == 1
    t, decision = decisions[0]
    assert t == 17 and decision.add == 1 and not decision.remove
    assert decision.reason == "demand 6.0 in flight per replica above 4 for 10 s"


def test_grows_to_what_the_demand_needs_at_once_counting_replicas_on_their_way():
    rules = ScalingRules(1, 8, up_in_flight=4, up_window_s=10, down_window_s=30, cooldown_s=20)
    policy = ScalingPolicy(rules)
    # 9 in flight on one replica: 3 replicas carry it at 4 or fewer each. Both new ones start at once.
    assert run(policy, [snap(t, (9, t)) for t in range(0, 11)]) == [
        (10, Decision(add=2, reason=policy_reason(9, 10)))
    ]
    # They take 40 s to serve: demand on g0 stays high meanwhile, but it is already counted.
    assert run(policy, [snap(t, (9, t), starting=2) for t in range(11, 51)]) == []
    # Serving now, and demand grew to 20 over the three: 5 carry it, two more at once (the demand on the
    # serving replicas has been above 4 for longer than the window, and the cooldown is over).
    decisions = run(policy, [snap(t, (7, t), (7, t), (6, t)) for t in range(51, 70)])
    assert [(t, d.add) for t, d in decisions] == [(51, 2)]
    # Never beyond max_replicas, however high the demand.
    assert policy.observe(snap(100, *[(90, 100)] * 5)).add == 3


def policy_reason(demand: float, window: int) -> str:
    return f"demand {demand:.1f} in flight per replica above 4 for {window} s"


def test_cooldown_holds_the_next_automatic_change():
    rules = ScalingRules(1, 3, up_in_flight=4, up_window_s=2, down_window_s=30, cooldown_s=20)
    policy = ScalingPolicy(rules)
    assert [t for t, _ in run(policy, [snap(t, (9, t)) for t in range(0, 3)])] == [2]
    # Already two serving and overloaded right away: the window passes at 5, the cooldown only at 22.
    decisions = run(policy, [snap(t, (9, t), (9, t)) for t in range(3, 30)])
    assert [t for t, _ in decisions] == [22]


def test_never_above_max_replicas():
    policy = ScalingPolicy(RULES)
    assert run(policy, [snap(t, (50, t), (50, t), (50, t)) for t in range(0, 200)]) == []


def test_shrinks_the_newest_replica_that_stayed_idle_for_the_window():
    policy = ScalingPolicy(RULES)
    # g0 stays busy; g1 and g2 are idle (nothing in flight, request counters unchanged) from t=0.
    samples = [snap(t, (2, t), (0, 5), (0, 7)) for t in range(0, 40)]
    decisions = run(policy, samples)
    assert decisions[0] == (30, Decision(remove=("g2",), reason="g1, g2 idle for 30 s"))


def test_the_window_is_any_replicas_but_the_newest_idle_one_goes():
    policy = ScalingPolicy(RULES)
    # g0 idle from 0 (the new g1 takes the trickle that is left), g1 idle too from 25.
    samples = [snap(t, (0, 0), (1, t)) for t in range(0, 25)] + [
        snap(t, (0, 0), (0, 25)) for t in range(25, 40)
    ]
    assert run(policy, samples)[0] == (30, Decision(remove=("g1",), reason="g0 idle for 30 s"))


def test_a_replica_that_got_requests_between_samples_is_not_idle():
    """Short requests finish between samples: in_flight reads 0, but the routed counter moved."""
    policy = ScalingPolicy(RULES)
    samples = [snap(t, (2, t), (0, t)) for t in range(0, 100)]
    assert run(policy, samples) == []


def test_never_below_min_and_never_while_demand_is_high_or_replicas_are_out():
    policy = ScalingPolicy(RULES)
    assert run(policy, [snap(t, (0, 0)) for t in range(0, 100)]) == []  # one replica = min
    # Mean demand 5 > 4: no shrink although g1 idles (the prefix guard may keep it idle briefly).
    assert run(ScalingPolicy(RULES), [snap(t, (10, t), (0, 1)) for t in range(0, 9)]) == []
    # One replica restarting: capacity is already short, keep the idle one.
    assert run(ScalingPolicy(RULES), [snap(t, (1, t), (0, 1), unavailable=1) for t in range(0, 100)]) == []


def test_below_min_is_restored_at_once():
    policy = ScalingPolicy(
        ScalingRules(2, 4, up_in_flight=4, up_window_s=10, down_window_s=30, cooldown_s=20)
    )
    assert policy.observe(snap(0, (0, 0))) == Decision(add=1, reason="below min_replicas")
    assert policy.observe(snap(1, (0, 0), starting=1)) is None


def test_queued_requests_count_as_demand_even_with_no_replica_serving():
    policy = ScalingPolicy(RULES)
    decisions = run(policy, [snap(t, (1, t), queued=8) for t in range(0, 11)])
    assert [(t, d.add) for t, d in decisions] == [(10, 2)]  # 9 requests: 3 replicas at 4 or fewer
    assert PoolSnapshot(0, {}, queued=3).demand == float("inf")
    assert PoolSnapshot(0, {}).demand == 0


def test_manual_target_goes_there_at_once_and_holds_until_handed_back():
    policy = ScalingPolicy(RULES)
    policy.set_target(3)
    assert policy.observe(snap(0, (0, 0))) == Decision(add=2, reason="manual: target 3")
    assert policy.observe(snap(1, (0, 0), starting=2)) is None
    # At the target, no automatic shrink, however idle.
    assert run(policy, [snap(t, (0, 0), (0, 0), (0, 0)) for t in range(2, 200)]) == []
    # Down to 1: idle replicas first, newest first; g1 is busy.
    policy.set_target(1)
    assert policy.observe(snap(200, (0, 0), (3, 9), (0, 0))) == Decision(
        remove=("g2", "g0"), reason="manual: target 1"
    )
    # Handed back: automatic again, cooldown counted from the manual change.
    policy.set_target(None)
    decisions = run(policy, [snap(t, (9, t)) for t in range(201, 240)])
    assert [t for t, _ in decisions] == [220]


def test_manual_target_leaves_starting_replicas_to_finish():
    policy = ScalingPolicy(RULES)
    policy.set_target(1)
    assert policy.observe(snap(0, (0, 0), starting=1)) is None  # nothing serving can go but the last one
    assert policy.observe(snap(1, (0, 0), (0, 0))) == Decision(remove=("g1",), reason="manual: target 1")
    policy.set_target(2)  # three on the way, one serving: nothing serving is drained below the target
    assert policy.observe(snap(2, (0, 0), starting=2)) is None


@pytest.mark.parametrize("target", [0, 4])
def test_manual_target_outside_the_bounds_is_refused(target):
    policy = ScalingPolicy(RULES)
    with pytest.raises(
        ValueError,
        match=rf"{target} replicas is outside generator.min_replicas=1 .. generator.max_replicas=3",
    ):
        policy.set_target(target)
    assert policy.manual_target is None


def test_rules_refuse_impossible_bounds():
    with pytest.raises(ValueError, match="min_replicas=3 <= max_replicas=2"):
        ScalingRules(3, 2, up_in_flight=1, up_window_s=1, down_window_s=1, cooldown_s=0)
    assert not ScalingRules(2, 2, 1, 1, 1, 0).elastic


# -- the config bounds ------------------------------------------------------------------------------


def test_bounds_default_to_the_started_replicas():
    g = load_config(None, ["run_name=t", "generator.replicas=3"]).generator
    assert g.replica_bounds == (3, 3)
    g = load_config(None, ["run_name=t", "generator.replicas=1", "generator.max_replicas=4"]).generator
    assert g.replica_bounds == (1, 4)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["generator.min_replicas=3", "generator.max_replicas=2"],
         r"generator\.min_replicas=3 exceeds generator\.max_replicas=2"),
        (["generator.replicas=1", "generator.min_replicas=2", "generator.max_replicas=4"],
         r"generator\.replicas=1 must lie within generator\.min_replicas=2 \.\. generator\.max_replicas=4"),
        (["generator.replicas=3", "generator.max_replicas=2"],
         r"generator\.replicas=3 must lie within generator\.min_replicas=3 \.\. generator\.max_replicas=2"),
        (["generator.min_replicas=0"], r"generator\.min_replicas\n\s+Input should be greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_bounds_are_refused_naming_the_fields(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, ["run_name=t", *overrides])


def test_an_add_that_failed_holds_the_next_ones_longer_each_time_until_one_succeeds():
    """A start that fails in seconds (no node can take it, vLLM dies at start) is not retried every sample
    with a new actor: the next add waits cooldown_s, then twice that, ...; manual and below-min adds too."""
    policy = ScalingPolicy(
        ScalingRules(2, 4, up_in_flight=4, up_window_s=10, down_window_s=30, cooldown_s=20)
    )
    assert policy.observe(snap(0, (0, 0))) == Decision(add=1, reason="below min_replicas")
    policy.add_failed(now=5)
    assert next(t for t in range(5, 60) if policy.observe(snap(t, (0, 0)))) == 25  # held for 20 s
    policy.add_failed(now=30)
    assert next(t for t in range(30, 120) if policy.observe(snap(t, (0, 0)))) == 70  # then 40 s
    policy.add_failed(now=75)
    policy.set_target(3)  # an operator's target waits too: the same start would fail the same way
    assert next(t for t in range(75, 200) if policy.observe(snap(t, (0, 0)))) == 155  # then 80 s
    policy.add_succeeded()
    policy.set_target(4)
    assert policy.observe(snap(156, (0, 0), starting=1)) == Decision(add=2, reason="manual: target 4")


def test_the_hold_after_failed_adds_is_bounded_and_never_holds_a_shrink():
    from rl_cluster.core.scaling import MAX_BACKOFF_S

    policy = ScalingPolicy(RULES)
    for _ in range(20):
        policy.add_failed(now=0)
    assert policy.observe(snap(MAX_BACKOFF_S - 1, (0, 0))) is None
    policy.set_target(2)
    assert policy.observe(snap(MAX_BACKOFF_S, (0, 0))).add == 1  # 600 s at most, however many failed
    policy.set_target(1)
    policy.add_failed(now=1000)
    assert policy.observe(snap(1001, (0, 0), (0, 0))) == Decision(remove=("g1",), reason="manual: target 1")
