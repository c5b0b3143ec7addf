"""Nothing outside the compat modules touches what TRL, transformers or accelerate keep private.

Private state and methods change between releases without notice; reaching into them is a workaround,
and every workaround lives in rl_cluster/trainer/compat.py or rl_cluster/generator/vllm_compat.py with
its reason and a test on the real upstream object. This walks the rest of the package for an attribute
whose name is private in those libraries' trainer code (assigned as `self._x` or defined as a method `_x`
there), read, written or overridden.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rl_cluster"
# rollout.py is the rollout child's loop, a subclass of TRL's private `_AsyncRolloutLoop` whose overrides
# are compat items (numbered in compat.py's list).
COMPAT = {
    PACKAGE / "trainer" / "compat.py",
    PACKAGE / "trainer" / "rollout.py",
    PACKAGE / "generator" / "vllm_compat.py",
}
# The upstream code the trainer subclasses, wraps or drives.
UPSTREAM = ["trl.experimental.async_grpo", "transformers.trainer", "transformers.trainer_callback",
            "accelerate.data_loader"]  # fmt: skip


def upstream_files() -> list[Path]:
    files = []
    for name in UPSTREAM:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin)
        files += sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" else [origin]
    return files


def private_names(tree: ast.AST) -> set[str]:
    """`_x` assigned on self or defined as a method in a class (dunders excluded)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names |= {f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


UPSTREAM_PRIVATE = set().union(*(private_names(ast.parse(p.read_text())) for p in upstream_files()))
WRAPPERS = (
    "trl",
    "transformers",
    "accelerate",
    "peft",
    "rl_cluster.trainer.compat",
    "rl_cluster.trainer.rollout",
)


def touches(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Upstream-private names `path` uses: on any object but `self` anywhere, and on `self` or as a method
    in a class built on an upstream class (or on a compat class, which wraps one). A class of our own may
    well have a `_retry` of its own."""
    tree = ast.parse(path.read_text())
    upstream = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(WRAPPERS)
        for alias in node.names
    }
    derived = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and {ast.unparse(b).split(".")[0] for b in node.bases} & upstream
    ]
    in_derived = {id(n) for cls in derived for n in ast.walk(cls)}
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in UPSTREAM_PRIVATE:
            if not _on_self(node) or id(node) in in_derived:
                found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in UPSTREAM_PRIVATE:
            found += [f"{where} def {node.name}"] if id(node) in in_derived else []
    return found


def test_only_the_compat_modules_touch_upstream_private_attributes():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path not in COMPAT for hit in touches(path)]
    assert not found, "move these into compat (numbered, with why and a test):\n" + "\n".join(found)


def test_the_walk_knows_what_trl_keeps_private_and_finds_it():
    """The check could pass by knowing nothing; it knows the names compat works with, and finds them."""
    assert {"_sync_weight_lora", "_lora_name", "_trained_groups", "_mp_ctx", "_inner_training_loop"} <= (
        UPSTREAM_PRIVATE
    )
    assert touches(PACKAGE / "trainer" / "compat.py")  # where they are allowed, and are


def test_the_walk_finds_an_override_and_a_reach_into_trl(tmp_path):
    source = tmp_path / "rl_cluster" / "reach.py"
    source.parent.mkdir()
    source.write_text(
        "from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer\n"
        "class Mine(AsyncGRPOTrainer):\n"
        "    def _sync_weight_lora(self, t0):\n"
        "        return self._lora_name\n"
        "class Plain:\n"
        "    def _retry(self):\n"
        "        return self._metrics\n"
        "def reach(trainer):\n"
        "    return trainer.rollout_worker._mp_ctx\n"
    )
    hits = [hit.split(" ", 1)[1] for hit in touches(source, root=tmp_path)]
    assert sorted(hits) == ["._lora_name", "._mp_ctx", "def _sync_weight_lora"]
