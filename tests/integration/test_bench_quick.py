"""`python -m bench --quick` end to end, so the benchmarks do not rot: every table must be there and
hold numbers, not placeholders or failures. Starts real vLLM servers, vllm-router, moto and Ray."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]

SECTIONS = {
    "## 1. Routing": 3,  # at least our prefix policy and vllm-router's two policies
    "## 2. Proxy overhead": 2,
    "## 3. Handoff": 3,
    "## 4. Scaling": 2,
    "## 5. Asynchronous vs synchronous GRPO": 2,
}
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table after `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    first_table = section.split("\n|", 1)[1].split("\n\n", 1)[0]
    lines = ("|" + first_table).splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_bench_quick(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "FAILED" not in text
    for heading, min_rows in SECTIONS.items():
        assert heading in text, heading
        rows = table_rows(text, heading)
        assert len(rows) >= min_rows, (heading, rows)
        for row in rows:
            # The label column aside, every cell holds a number ("-" marks a column that does not apply).
            values = [cell for cell in row[1:] if cell != "-"]
            assert values and all(NUMBER.search(cell) for cell in values), (heading, row)
            assert not any("n/a" in cell or "nan" in cell.lower() for cell in row), (heading, row)
    assert re.search(r"Speedup of asynchronous over synchronous: \d+\.\d+x measured; ideal \d+\.\d+x", text)
    assert "Machine: " in text and "vllm" in text and "command: `python -m bench --quick" in text
    for plot in ("routing", "overhead", "handoff", "scaling", "async_vs_sync"):
        assert (tmp_path / f"{plot}.png").stat().st_size > 0
