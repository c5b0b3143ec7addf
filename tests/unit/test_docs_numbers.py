"""The numbers the docs quote, tied to where they come from: BENCHMARKS.md (written by `make bench`), the
shipped configs, the code and the Makefile. A re-run of the benchmarks or a changed default that leaves
a page behind fails here, not in a reader's hands."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from rl_cluster.core.summary import exit_status
from rl_cluster.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def read(name: str) -> str:
    return (REPO / name).read_text()


def benchmark_section(number: int) -> str:
    return read("BENCHMARKS.md").split(f"\n## {number}. ", 1)[1].split("\n## ", 1)[0]


def table_cell(section: str, row: str, column: int) -> str:
    (line,) = [line for line in section.splitlines() if line.startswith(f"| {row} |")]
    return line.strip("|").split("|")[column].strip()


def test_serving_quotes_the_proxy_capacity_benchmarks_measured():
    rate = {
        n: int(table_cell(benchmark_section(6), f"rl_cluster proxy ({n} upstreams)", 1)) for n in (8, 256)
    }
    quoted = f"routes {rate[8]:,} requests/s in front of 8 replicas and {rate[256]:,} in front of 256"
    assert quoted in " ".join(read("docs/serving.md").split()), rate


def test_metrics_quotes_the_experience_store_size_benchmarks_measured():
    per_group = re.search(r"\((\d+) bytes per group", benchmark_section(7)).group(1)
    assert f"take {per_group} bytes a group" in read("docs/metrics.md")


def test_training_names_the_mean_at_k_cpu_math_asks_for():
    k = tomllib.loads(read("jobs/configs/cpu_math.toml"))["eval"]["samples_k"]
    assert re.findall(r"mean@(\d+) ≈", read("docs/training.md")) == [str(k)]


def test_tests_md_gives_the_chaos_runs_length():
    steps = int(re.search(r"^CHAOS_STEPS = (\d+)$", read("tests/e2e/test_multinode.py"), re.M).group(1))
    assert f"set to {steps:,} steps it never reaches" in " ".join(read("docs/tests.md").split())


def test_the_readmes_exit_status_table_is_the_codes():
    table = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")[1:]]
        for line in read("README.md").splitlines()
        if line.startswith("| `")
    }
    stopped, finished = {"status": "stopped"}, {"status": "finished"}
    assert exit_status(stopped) == 1 and "stopped" in table["`train`"][1]
    assert exit_status(finished | {"served_check": {"checks": 3, "mismatch": 1}}) == 3
    assert "did not serve the trained adapter" in table["`train`"][3]
    assert exit_status(finished | {"served_check": {"checks": 3, "mismatch": 0}}) == 0
    assert UsageError("x").exit_status == 2 and "refused before it started" in table["`train`"][2]
    assert set(table) == {f"`{c}`" for c in ("train", "serve", "scale", "data", "experience")} | {
        "`summary`, `runs`"
    }


def test_readme_says_what_make_clean_deletes():
    removed = re.search(r"^clean:\n\trm -rf (.+)$", read("Makefile"), re.M).group(1).split()
    assert removed == ["$(VENV)", ".cache", "bucket"]
    assert "make clean  # deletes .venv/, .cache/ and bucket/" in read("README.md")


def test_servings_comparison_quotes_the_benchmarks_measured():
    """docs/serving.md's table beside Ray Serve LLM and vllm-router: every measured number it quotes."""
    page = " ".join(read("docs/serving.md").split("## Why not Ray Serve LLM or vllm-router", 1)[1].split())
    at_scale = benchmark_section(9)
    ours = [table_cell(at_scale, "rl_cluster proxy, prefix", i) for i in (1, 2, 3)]
    theirs = [table_cell(at_scale, "vllm-router, cache_aware", i) for i in (1, 2, 3)]
    assert (
        f"{ours[0]} engine prefix-cache hits over {ours[2].split()[0]} replicas, busiest {ours[1]}x" in page
    )
    assert f"{theirs[0]} over {theirs[2].split()[0]} replicas, busiest {theirs[1]}x" in page
    capacity = benchmark_section(6)
    rate = int(table_cell(capacity, "rl_cluster proxy (8 upstreams)", 1))
    router = int(table_cell(capacity, "vllm-router, cache_aware (8 upstreams)", 1))
    assert f"{rate:,} in front of 8 replicas" in page and f"{router:,} ({router / rate:.1f}x ours" in page
    handoff = table_cell(benchmark_section(3), "directory bucket, proxy, 2 replicas", 4).split(" / ")[0]
    assert f"publish -> routable {handoff} ms p50 on two replicas" in page
    sync = table_cell(benchmark_section(8), "256", 1)
    assert f"one sync on 256 replicas {round(float(sync))} ms p50" in page
    # "on two replicas it sent every request to one"
    assert table_cell(benchmark_section(1), "vllm-router, cache_aware", 3) == "100.0%"
