"""The README's layout map lists every module of rl_cluster/, and nothing that is not there.

The map is the first code block under `## Layout`: a tree, two spaces per level, each entry a name (a
folder ends in `/`) followed by two or more spaces and a line of text; a description that runs on
continues on lines indented to the description column, which never start an entry.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rl_cluster"
README = REPO / "README.md"

# An entry: indent, then a folder (`name/`) or a module (`name.py`), then the description or the line's end.
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+/|[\w.]+\.py)(?: {2,}\S|$)")
DESCRIPTION_COLUMN = 16  # an entry's name starts left of this; continuation lines start right of it


def layout_block(readme: str) -> list[str]:
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].split("\n")[1:]


def listed_paths(block: list[str]) -> set[str]:
    """The paths the tree names, relative to the repository root (`rl_cluster/core/routing.py`)."""
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the folders enclosing the current line
    paths = set()
    for line in block:
        match = ENTRY.match(line)
        if not match or len(match["indent"]) >= DESCRIPTION_COLUMN:
            continue
        indent, name = len(match["indent"]), match["name"]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        paths.add(path)
        if name.endswith("/"):
            stack.append((indent, path))
    return paths


def modules() -> set[str]:
    """Every module file of the package but empty `__init__.py` files (a package with nothing in it)."""
    return {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and (p.name != "__init__.py" or p.read_text().strip())
    }


def test_the_parser_reads_a_tree():
    block = [
        "pkg/                    intro",
        "                        more/ of the intro, not an entry",
        "  a.py                  module a",
        "  sub/                  a package",
        "    b.py                module b",
        "                        c.py: a continuation, not an entry",
        "  d.py",
        "other/                  a top-level folder",
    ]
    assert listed_paths(block) == {"pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.py", "pkg/d.py", "other/"}


def test_every_module_is_in_the_readme_layout_map():
    listed = {p for p in listed_paths(layout_block(README.read_text())) if p.endswith(".py")}
    missing = sorted(modules() - listed)
    assert not missing, f"README.md's layout map (## Layout) lacks {missing}: add one short line for each"
    stale = sorted(p for p in listed if p.startswith("rl_cluster/") and not (REPO / p).is_file())
    assert not stale, f"README.md's layout map lists modules that do not exist: {stale}"


def test_every_package_is_a_folder_of_the_map():
    listed = listed_paths(layout_block(README.read_text()))
    packages = {f"{p.parent.relative_to(REPO).as_posix()}/" for p in PACKAGE.rglob("__init__.py")}
    missing = sorted(packages - listed)
    assert not missing, f"README.md's layout map lacks the folders {missing}"
