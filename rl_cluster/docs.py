"""`python -m rl_cluster.docs`: regenerate docs/configuration.md's config reference from the pydantic docstrings."""

from pathlib import Path

from rl_cluster.config import config_reference

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name, default, doc in config_reference():
        lines.append(f"| `{name}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def with_reference(text: str) -> str:
    """`text` with the part between the BEGIN and END markers replaced by the current reference."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference_markdown()}\n{END}{tail}"


def update_reference(path: Path = REFERENCE) -> None:
    path.write_text(with_reference(path.read_text()))


if __name__ == "__main__":
    update_reference()
