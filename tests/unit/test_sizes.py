"""No long module, function or class in rl_cluster/ or above it (bench/, loopback.py): a reader holds a
function (~60 lines) or a class (~250) in view at once, and a module (~400) is one concept. What is still
over the limits is listed here with its size now, to be split: an entry must not grow, and one that got
under its limit must leave the list (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*(REPO / "rl_cluster").rglob("*.py"), REPO / "loopback.py", *(REPO / "bench").rglob("*.py")]
FUNCTION_LINES, CLASS_LINES, MODULE_LINES = 60, 250, 400
# name (a module's path, or path:name) -> its size when it was listed; each still to be split.
STILL_LONG = {
    "rl_cluster/bucket/__init__.py:Bucket": 258,
    "rl_cluster/trainer/compat.py": 436,
}


def sizes() -> dict[str, tuple[int, int]]:
    """Every module, function and class: name -> (lines, its limit)."""
    found = {}
    for path in sorted(SOURCES):
        text = path.read_text()
        found[path.relative_to(REPO).as_posix()] = (len(text.splitlines()), MODULE_LINES)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
                name = f"{path.relative_to(REPO).as_posix()}:{node.name}"
                found[name] = (node.end_lineno - node.lineno + 1, limit)
    return found


def test_nothing_over_its_limit_but_the_listed_ones():
    over = {name: lines for name, (lines, limit) in sizes().items() if lines > limit}
    new = {name: lines for name, lines in over.items() if name not in STILL_LONG}
    limits = f"{FUNCTION_LINES} lines a function, {CLASS_LINES} a class, {MODULE_LINES} a module"
    assert not new, f"over the limit ({limits}): {new}"
    grown = {
        name: (STILL_LONG[name], lines) for name, lines in over.items() if lines > STILL_LONG.get(name, lines)
    }
    assert not grown, f"listed as still too long, and grew since (listed, now): {grown}"
    done = sorted(set(STILL_LONG) - set(over))
    assert not done, f"under the limit now: take them off STILL_LONG in {__file__}: {done}"


def test_the_count_sees_bench_and_modules():
    """The check could pass by looking only at rl_cluster/, or at functions only; it does not."""
    found = sizes()
    assert found["bench/report.py:write"][1] == FUNCTION_LINES and "loopback.py:moto_s3" in found
    assert found["rl_cluster/core/routing.py"][1] == MODULE_LINES
