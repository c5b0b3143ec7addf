"""The Grafana dashboard (ray_configs/grafana/) queries only metrics rl_cluster exports, and every one of them:
a metric added to rl_cluster.core.telemetry or rl_cluster.proxy.metrics needs a panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cluster.metric_names import all_metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "ray_configs" / "grafana" / "rl_cluster_dashboard.json"
DATASOURCE = "${datasource}"
RUN_FILTER = 'run=~"$run"'
# A metric name and the label selector after it, if any: `ray_x{run=~"$run"}[1m]` -> ("ray_x", '{run=~"$run"}').
SELECTOR = re.compile(r"(ray_[a-zA-Z0-9_:]+)(\{[^}]*\})?")


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, rows' own panels (a collapsed row holds its panels) included."""
    return [q for p in panels for q in [p, *all_panels(p.get("panels", []))]]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def graphs(dashboard) -> list[dict]:
    return [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]


def test_variables_are_datasource_and_run(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    run = variables["run"]
    assert run["datasource"]["uid"] == DATASOURCE
    assert run["definition"] == run["query"]["query"] == "label_values(ray_rl_trainer_step, run)"
    assert set(SELECTOR.findall(run["definition"])) <= {(name, "") for name in all_metric_names()}


def test_rows_per_actor_kind(dashboard):
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Trainer", "Proxy", "Generators"]


def test_panels_have_ids_titles_and_the_templated_datasource(dashboard, graphs):
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in graphs:
        assert panel["title"], panel
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DATASOURCE, panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_panels_do_not_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_names_exported_metrics_of_the_selected_run(graphs):
    known = all_metric_names()
    for panel in graphs:
        for target in panel["targets"]:
            found = SELECTOR.findall(target["expr"])
            assert found, target["expr"]
            for name, selector in found:
                assert name in known, f"{panel['title']!r} queries {name}, which rl_cluster does not export"
                assert RUN_FILTER in selector, f"{panel['title']!r}: {name} is not filtered on {RUN_FILTER}"


def test_every_exported_metric_has_a_panel(graphs):
    queried = {name for p in graphs for t in p["targets"] for name, _ in SELECTOR.findall(t["expr"])}
    assert all_metric_names() - queried == set()


def test_histograms_show_quantiles(graphs):
    exprs = [t["expr"] for p in graphs for t in p["targets"]]
    for name in sorted(n for n in all_metric_names() if n.endswith("_bucket")):
        for q in ("0.5", "0.9"):
            assert any(e.startswith(f"histogram_quantile({q}, ") and name in e for e in exprs), (name, q)
