"""The markdown BENCHMARKS.md is built of: numbers, shares, ranges, tables, the line naming the run a
section comes from, a failed section. Its own module below the sections (bench.report, bench.report_scale,
bench.trainer_ranks), which all use it."""

from __future__ import annotations

import math

PLACEHOLDER = "n/a"


def num(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return PLACEHOLDER
    return format(value, spec)


def pct(value) -> str:
    return PLACEHOLDER if value is None or value != value else f"{100 * value:.1f}%"


def span(bounds) -> str:
    low, high = bounds
    return f"{num(low, '.1f')}-{num(high, '.1f')}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(info: dict, command: str) -> str:
    return (
        f"<sub>Machine: {info['cores']} cores, {info['cpu']}, no GPU · {info['date']} · "
        f"{info['versions']} · python {info['python']} · command: `{command}`</sub>"
    )


def failure_section(title: str, error: str) -> str:
    return f"## {title}\n\nFAILED: {error}"
