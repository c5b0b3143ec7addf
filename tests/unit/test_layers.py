"""The import structure of rl_cluster and of what stands above it: floors, no circle, nothing climbing up.

Every module of rl_cluster stands on one floor; a module may import from its own floor or below, never
from above, and no chain of imports (function-level imports count: they are deferred, not absent) comes
back to where it started. A new module has to be given a floor here, which is the point: it makes its
place in the house a decision. Above the package stand its consumers, which it never imports: loopback.py
(what the tests and the benchmarks start on loopback) and the benchmarks (bench/), held to the same rules.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rl_cluster"
TESTS = REPO / "tests"
# Lowest first: the modules of each floor, named without `rl_cluster.`; a module takes the floor of the
# longest name that is it or a package above it.
FLOORS = [
    # 0: pure logic and plain data: no Ray, vLLM, torch or HTTP library.
    "errors config config_errors core docs",
    # 1: one resource each: the bucket, the model files, the datasets, plots, Ray metrics, node facts.
    "bucket models tiny data plots telemetry nodes",
    # 2: the rooms, each a process kind (one may use another's pure helper, never its actor).
    "generator proxy trainer experience",
    # 3: placing and sizing the actors of a run.
    "connection credentials cluster pool pool_state trainer_calls",
    # 4: a run start to end, and the commands that start one.
    "run runs serve scale cli commands data.__main__ experience.__main__",
]
# Above the package, lowest first (a module's floor is its top-level name's): floor 5, 6.
CONSUMERS = ["loopback", "bench"]
ROOTS = {"rl_cluster", *CONSUMERS}
# Floor 0 stays pure (core/'s tests run in milliseconds, the config loads anywhere): none of these, not
# even inside a function.
HEAVY = {"ray", "vllm", "torch", "aiohttp", "requests", "transformers", "trl", "peft", "s3fs"}
# bench's own tests: the only tests that import bench (the rest share loopback.py and conftest with it).
BENCH_TESTS = {
    "tests/unit/test_bench_correction.py",
    "tests/unit/test_fleet_cache.py",
    "tests/unit/test_pool_step.py",
    "tests/integration/test_bench_quick.py",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = [*PACKAGE.rglob("*.py"), REPO / "loopback.py", *(REPO / "bench").rglob("*.py")]
MODULES = {module_name(p): p for p in SOURCES}


def floor(module: str) -> int:
    root = module.partition(".")[0]
    if root in CONSUMERS:
        return len(FLOORS) + CONSUMERS.index(root)
    if module == "rl_cluster":
        return 0
    matches = [
        (len(name), number)
        for number, names in enumerate(FLOORS)
        for name in names.split()
        if module == f"rl_cluster.{name}" or module.startswith(f"rl_cluster.{name}.")
    ]
    assert matches, f"{module} stands on no floor: add it to FLOORS in {__file__}"
    return max(matches)[1]


def imported(path: Path) -> set[str]:
    """Every name the file at `path` imports anywhere in its body, dotted in full (`from a import b`: a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; the house uses absolute ones")
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def imports(module: str) -> set[str]:
    """The modules of the house (rl_cluster's and its consumers') that `module` imports."""
    found = set()
    for name in imported(MODULES[module]):
        if name.partition(".")[0] not in ROOTS:
            continue
        while name not in MODULES and "." in name:
            name = name.rpartition(".")[0]
        if name in MODULES and name != module:
            found.add(name)
    return found


GRAPH = {module: imports(module) for module in MODULES}


def test_every_module_stands_on_a_floor_and_imports_nothing_above_it():
    climbing = [
        f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if floor(target) > floor(module)
    ]
    assert not climbing, "\n".join(climbing)


def test_no_import_circle():
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(GRAPH[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])


def test_the_walk_sees_function_level_imports():
    """The check could pass by missing the deferred imports that made today's circles; it does not."""
    assert "rl_cluster.trainer.compat" in GRAPH["rl_cluster.trainer.rank"]  # imported inside train()
    assert floor("rl_cluster.core.routing") == 0 and floor("rl_cluster.run") == 4
    assert floor("rl_cluster.data.__main__") == 4 and floor("rl_cluster.data") == 1
    assert "rl_cluster.trainer.compat" in GRAPH["bench.trainer_ranks"] and floor("bench.report") == 6
    assert floor("loopback") == 5 and "loopback" in GRAPH["bench.handoff"]


def test_floor_zero_imports_no_heavy_library():
    """No Ray, vLLM, torch, HTTP client, TRL/PEFT/transformers or s3fs in errors, config, core (floor 0)."""
    heavy = [
        f"{module} imports {name}"
        for module in sorted(MODULES)
        if floor(module) == 0
        for name in sorted(imported(MODULES[module]))
        if name.partition(".")[0] in HEAVY
    ]
    assert not heavy, "\n".join(heavy)
    assert {"rl_cluster.errors", "rl_cluster.config", "rl_cluster.core.routing"} <= {
        module for module in MODULES if floor(module) == 0
    }


def test_tests_and_bench_stand_apart():
    """Only bench's own tests import bench, and bench imports nothing of tests/ (conftest, a test module, a
    harness): what both need lives in loopback.py."""
    test_files = [p for p in TESTS.rglob("*.py") if p.relative_to(REPO).as_posix() not in BENCH_TESTS]
    into_bench = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted(test_files)
        for name in sorted(imported(path))
        if name.partition(".")[0] == "bench"
    ]
    assert not into_bench, "\n".join(into_bench)
    test_names = {"tests", "conftest", *(p.stem for p in TESTS.rglob("*.py"))}
    into_tests = [
        f"{module} imports {name}"
        for module in sorted(MODULES)
        for name in sorted(imported(MODULES[module]))
        if name.partition(".")[0] in test_names
    ]
    assert not into_tests, "\n".join(into_tests)
