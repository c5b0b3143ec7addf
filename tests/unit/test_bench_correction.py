"""Section 11 of BENCHMARKS.md from the numbers of a run: the table, the pick, and the plot (the quick bench,
which CI runs, leaves the nine training runs out)."""

from bench.correction import run_record, summarize
from bench.plots import correction as draw
from bench.report import correction_section
from rl_cluster.core.summary import step_record


class Plan:
    correction_steps, correction_seeds = 10, 2


def result(rewards, ratio_max, share, verdict="match"):
    logs = [{"reward": r, "sample/staleness_mean": 2.0, "correction/ratio_mean": 1.0,
             "correction/ratio_max": ratio_max, "correction/share_corrected": share} for r in rewards]  # fmt: skip
    syncs = [{"check": {"verdict": verdict, "replicas": [{"floor": 5e-3, "distance": 6e-3}]}}]
    return {"history": [step_record(i + 1, log, i, None) for i, log in enumerate(logs)], "syncs": syncs}


def test_the_section_tables_each_method_over_its_seeds_and_names_the_best(tmp_path):
    runs = {
        "none": [run_record("none", s, result([0.1] * 5 + [0.4 + s / 10] * 5, 2.0, 0.0)) for s in range(2)],
        "icepop": [
            run_record("icepop", s, result([0.1] * 5 + [0.5 + s / 10] * 5, 2.0, 0.001)) for s in range(2)
        ],
    }
    r = summarize(runs, Plan)
    icepop = next(row for row in r["rows"] if row["method"] == "icepop")
    assert icepop["reward_last_fifth_min"] == 0.5 and icepop["reward_last_fifth_max"] == 0.6
    assert icepop["checks"] == {"checks": 2, "match": 2, "too_close": 0, "mismatch": 0}
    text = correction_section(r)
    assert "| icepop | 0.100 | 0.550 (0.500 to 0.600) |" in text, text
    assert "Highest mean reward at equal steps: `icepop` (0.550)" in text and "spreads overlap" in text
    assert draw(r, tmp_path / "correction.png").stat().st_size > 1000
