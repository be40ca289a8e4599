"""Parameter objects: the base of the small frozen dataclass each policy and each selector owns.

A trigger policy (`policy.py`) or a selector (`selector.py`) declares its parameters as one dataclass
subclassing `Params`, each field with its default and a docstring; `SFIConfig` holds one instance of
the named policy's and the named selector's, and the command line makes its flags from the fields
(`field_help`). So each default is written once, next to the code that reads it.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Params:
    """Validated, immutable parameters; `validate` raises ValueError naming the first bad one."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first parameter that makes no sense (none here)."""

    # -- checks for `validate` -------------------------------------------------------------------
    def need(self, ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r}: {why}")

    def need_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        self.need(is_int(value) and value >= minimum, name, f"must be an integer >= {minimum}")

    def need_real(self, name: str, low: float = -math.inf, high: float = math.inf, *, above: bool = False) -> None:
        """A finite number in [low, high] (with above=True: > low); an infinite bound is open."""
        value = getattr(self, name)
        ok = is_real(value) and math.isfinite(value) and (value > low if above else value >= low) and value <= high
        if math.isinf(low) and math.isinf(high):
            why = "must be a finite number"
        elif math.isinf(high):
            why = f"must be a finite number {'>' if above else '>='} {low:g}"
        else:
            why = f"must be in [{low:g}, {high:g}]"
        self.need(ok, name, why)

    # -- introspection ---------------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def overrides(self) -> dict[str, Any]:
        """The fields that differ from the class defaults: {} for the defaults."""
        default = type(self)()
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) != getattr(default, name)}


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of a dataclass's fields (the string literal under each), from its source.

    Includes the fields inherited from dataclass bases; {} where the source cannot be read.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_help(cls: type, name: str) -> str:
    """One line for a command-line flag: the first sentence of the field's docstring and its default.

    A default of None is explained by the docstring's "None: ..." clause when it has one.
    """
    doc = " ".join(field_docs(cls).get(name, "").split())
    first = doc.split(". ")[0].rstrip(".")
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    if default is None and "None: " in doc:
        meaning = doc.split("None: ", 1)[1]
        meaning = meaning.split(". ")[0].split("; ")[0].rstrip(".")
        return f"{first} (default: {meaning})"
    return f"{first} (default: {default:g})" if isinstance(default, float) else f"{first} (default: {default})"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
