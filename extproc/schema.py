"""From YAML to the typed policy: one generic builder for every section of the policy file.

`build(cls, data, path)` turns a parsed YAML value into the dataclass `cls`, recursively, by the fields'
annotations:

    bool, int, float (finite; an integer is accepted), str      the YAML scalar, checked
    Literal["a", "b"]                                            one of the listed strings
    X | None                                                     null, or an X
    X | Y                                                        a mapping read as the mapping-shaped one, a list
                                                                 as the list one, a scalar as the other
    list[X], tuple[X, ...]                                       a YAML list of X
    dict[str, X]                                                 a mapping of non-empty names to X
    a dataclass                                                  a mapping, built by the same rules

Every error is a PolicyError whose message starts with the value's full path (`admission.lanes[1].max_tokens2:
unknown field ...`): unknown keys are errors at every level, a field without a default is required, and after an
object is built its `validate(path)` (when it has one) checks the rules that span fields. A dataclass field with
`metadata=INTERNAL` is not part of the file (e.g. `Policy.source`).

Every field is documented once, by a comment on its own line in the class body (continued by comment-only lines
right below it); `field_docs(cls)` reads them, and `deploy/gen_config_doc.py` renders docs/configuration.md from
the same words.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from functools import cache
from typing import Any, Literal, TypeVar

T = TypeVar("T")

INTERNAL = {"policy_file": False}  # field metadata: set by the program, not read from the policy file


class PolicyError(ValueError):
    """The policy file is invalid; the message starts with the path of the offending field."""


# ---- building ------------------------------------------------------------------------------------------------

def build(cls: type[T], data: Any, path: str) -> T:
    """The dataclass `cls` from a parsed YAML mapping (None: every default); raises PolicyError naming the field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{path or 'the policy'}: expected a mapping, got {type(data).__name__}")
    fields = file_fields(cls)
    hints = _hints(cls)
    unknown = [key for key in data if key not in fields]
    if unknown:
        what = "field" if path else "section"
        raise PolicyError(f"{_join(path, str(unknown[0]))}: unknown {what} (known: {', '.join(fields)})")
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise PolicyError(f"{_join(path, name)}: required field missing")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def file_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of `cls` that the policy file sets, in definition order."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("policy_file", True)}


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(_alternative(inner, value), value, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PolicyError(f"{path}: expected a mapping, got {type(value).__name__}")
        return build(tp, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise PolicyError(f"{path}: expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise PolicyError(f"{path}: expected a list, got {type(value).__name__}")
        item = typing.get_args(tp)[0]
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        val_t = typing.get_args(tp)[1]
        if not isinstance(value, dict):
            raise PolicyError(f"{path}: expected a mapping, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise PolicyError(f"{path}: keys must be non-empty strings, got {k!r}")
            out[k] = _convert(val_t, v, f"{path}.{k}")
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise PolicyError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise PolicyError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise PolicyError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported field type {tp!r}")  # a programming error, not a policy error


def _alternative(types_: list[Any], value: Any) -> Any:
    """Which type of a union (`str | DnsEntry`) a YAML value is read as: a mapping as the mapping-shaped one
    (a dataclass or dict), a list as the list one, anything else as the first other one."""
    def shape(tp: Any) -> str:
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp) or origin is dict:
            return "mapping"
        return "list" if origin in (list, tuple) else "scalar"

    wanted = "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"
    return next((tp for tp in types_ if shape(tp) == wanted), types_[0])


def to_dict(obj: Any) -> Any:
    """The plain YAML data of a built policy object (the inverse of `build`: build(cls, to_dict(x), p) == x)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_dict(getattr(obj, name)) for name in file_fields(type(obj))}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ---- validation helpers (for the `validate(path)` methods) ---------------------------------------------------

def require(cond: bool, path: str, message: str) -> None:
    """Raise PolicyError(`path message`) unless `cond`."""
    if not cond:
        raise PolicyError(f"{path} {message}")


def positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(v > 0, _join(path, name), f"must be > 0, got {v!r}")


def non_negative(obj: Any, path: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(v >= 0, _join(path, name), f"must be >= 0, got {v!r}")


def share(obj: Any, path: str, *names: str) -> None:
    """Each named field is a share in (0, 1]."""
    for name in names:
        v = getattr(obj, name)
        require(0 < v <= 1, _join(path, name), f"must be in (0, 1], got {v!r}")


# ---- documentation -------------------------------------------------------------------------------------------

@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's description: the comment on its line in the class body, plus the comment-only lines right
    below it (an empty dict when the source is not available)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = node.end_lineno or node.lineno
            text = comments.get(end) or comments.get(node.lineno)
            if not text:
                continue
            n = end + 1
            while n in comments and n not in code_lines:  # continuation lines
                text += " " + comments[n]
                n += 1
            out[node.target.id] = text
    return out
