"""The scaling policy under a demand step (bench.pool_step: the real ScalingPolicy, simulated serving)."""

from __future__ import annotations

import pytest

from bench.pool_step import RULES, simulate


@pytest.mark.parametrize("node_start_s", [30, 120])
def test_a_step_to_four_times_the_demand_is_served_one_node_start_after_the_window(node_start_s):
    run = simulate(node_start_s)
    # Every replica the step needs starts at the first decision (one at a time, the 30-second nodes took
    # 160 s and the 120-second ones never caught up within the five minutes).
    assert run["peak"] == run["needed"] and run["overshoot"] == 0, run
    assert node_start_s <= run["served_after_s"] <= node_start_s + RULES.up_window_s + RULES.cooldown_s, run
    # After it, one replica per idle window back to the minimum.
    assert run["back_to_min_after_s"] is not None
    sizes = [size for _, size, _ in run["timeline"]]
    assert sizes[0] == sizes[-1] == RULES.min_replicas and max(sizes) == run["needed"]
