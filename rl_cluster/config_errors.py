"""A config that does not load, said in one line per problem: what a user typed wrong, not pydantic's report.

pydantic's own message is three or four lines per error and repeats the whole config as `input_value`;
a typo should read `jobs/configs/x.toml: trainer.max_stepz: unknown field (did you mean max_steps?)`.
`explain` turns a ValidationError into such lines (pure: no IO); `load` is `load_config` for the entry
points, raising UsageError with those lines (exit status 2) for everything that is the config's fault.
"""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from pathlib import Path
from types import UnionType

from pydantic import BaseModel, ValidationError

from rl_cluster.config import RunConfig, load_config
from rl_cluster.errors import UsageError

# pydantic's int/float parsing messages end in a clause that the `(got ...)` says better.
_REDUNDANT = re.compile(r", unable to parse string as an? \w+$")
_SHOWN_INPUT_CHARS = 60


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _path(loc: tuple, root: type[BaseModel]) -> tuple[str, type[BaseModel] | None]:
    """The dotted name of what `loc` points at (`task.rewards[0]`, `task.data_files[train]`) and the model
    holding its last field, for did-you-mean. Union tags pydantic adds (`lora.target_modules.str`) are
    left out: they name a type the user did not write."""
    name, annotation, parent = "", root, None
    for part in loc:
        if _is_model(annotation):
            parent = annotation
            name = f"{name}.{part}" if name else str(part)
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field is not None else None
            continue
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, UnionType):
            continue  # a union member's tag, not a place in the config
        if origin in (list, dict) or isinstance(part, int):
            name += f"[{part}]"
            args = typing.get_args(annotation)
            annotation = args[-1] if args else None
    return name, parent


def _got(value) -> str:
    text = repr(value)
    if isinstance(value, dict) or len(text) > _SHOWN_INPUT_CHARS:
        return ""  # a section or a long value: the field name says enough
    return f" (got {text})"


def explain(error: ValidationError, root: type[BaseModel] = RunConfig) -> list[str]:
    """One line per problem, in pydantic's order; never the whole input. Errors of a union's members
    on the same field share a line (`... a valid string, or Input should be a valid list (got 3)`)."""
    lines: dict[str, list[str]] = {}  # the field's dotted name -> messages (order kept)
    got: dict[str, str] = {}
    for e in error.errors(include_url=False):
        name, parent = _path(tuple(e["loc"]), root)
        if e["type"] == "extra_forbidden":
            field = str(e["loc"][-1])
            close = difflib.get_close_matches(field, list(parent.model_fields) if parent else [], n=1)
            message = "unknown field" + (f" (did you mean {close[0]}?)" if close else "")
        elif e["type"] == "value_error" and (not name or _is_model(_annotation(name, root))):
            # A model validator: its message names the fields it compares.
            name, message = "", e["msg"].removeprefix("Value error, ")
        else:
            message = _REDUNDANT.sub("", e["msg"])
            got.setdefault(name, _got(e.get("input")))
        messages = lines.setdefault(name, [])
        if message not in messages:
            messages.append(message)
    return [
        (f"{name}: " if name else "") + ", or ".join(messages) + got.get(name, "")
        for name, messages in lines.items()
    ]


def _annotation(name: str, root: type[BaseModel]):
    """The annotation of a dotted field name made only of field names, else None."""
    annotation = root
    for part in name.split("."):
        field = annotation.model_fields.get(part) if _is_model(annotation) else None
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def load(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """`load_config`, with every way a config can be wrong as a UsageError of one line per problem."""
    where = f"{path}: " if path else ""
    try:
        return load_config(path, list(overrides))
    except ValidationError as e:
        raise UsageError(*(where + line for line in explain(e))) from e
    except FileNotFoundError as e:
        raise UsageError(f"{path}: no such file") from e
    except (OSError, tomllib.TOMLDecodeError, ValueError) as e:  # unreadable, not TOML, a bad override
        raise UsageError(f"{where}{e}") from e
