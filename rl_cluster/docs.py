"""`python -m rl_cluster.docs`: regenerate README.md's config reference from the pydantic docstrings."""

from pathlib import Path

from rl_cluster.config import config_reference

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name, default, doc in config_reference():
        lines.append(f"| `{name}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def update_readme(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{reference_markdown()}\n{END}{tail}")


if __name__ == "__main__":
    update_readme(Path(__file__).resolve().parents[1] / "README.md")
