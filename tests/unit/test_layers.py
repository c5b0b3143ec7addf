"""The package's import structure: floors, no circle, nothing climbing up.

Every module of rl_cluster stands on one floor; a module may import from its own floor or below, never
from above, and no chain of imports (function-level imports count: they are deferred, not absent) comes
back to where it started. A new module has to be given a floor here, which is the point: it makes its
place in the house a decision.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rl_cluster"

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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def floor(module: str) -> int:
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


def imports(module: str) -> set[str]:
    """The rl_cluster modules `module` imports anywhere in its body (absolute imports: the package has no
    relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: relative import; the package uses absolute ones")
        names = (
            [f"{node.module}.{a.name}" for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        for name in names:
            while name.startswith("rl_cluster") and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("rl_cluster") and name != module:
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
