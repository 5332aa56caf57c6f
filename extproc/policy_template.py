"""The commented policy file that `sluice init` writes: the built-in default policy's settings, and every other
field of every section listed commented out with its default, each under its description.

The descriptions are the field comments of the policy dataclasses (`extproc.schema.field_docs`, the same words
docs/configuration.md is generated from) and the defaults are the dataclasses' own, so the template cannot drift
from the code. A line is written active when it sets a value of the built-in default policy, or leads to one
(`gateway:` above `port: 8080`); everything else is commented out at its own indentation, so uncommenting a
field means removing the `# ` in front of its key (and of its section's key when that is commented too).
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

import yaml

from extproc.config import EMBEDDED_POLICY, Policy, read_policy_file
from extproc.schema import field_docs, file_fields, to_dict

WIDTH = 110  # description lines are wrapped to this many columns

HEADER = """\
# sluice policy file, written by `sluice init`. `sluice up` and the other commands read ./sluice.yaml from the
# current directory (or the file given with --config FILE); `sluice check` validates it.
#
# The lines that are not commented out are the built-in demo: Envoy on 127.0.0.1:8080 in front of three
# simulated vLLM replicas of `sim-model` (started by `sluice up`). Put your own replicas under `pools:`.
# Every other field is listed commented out, with its default, below its description: remove the `# ` in front
# of a key (and of its section's key) to set it. Unknown fields are errors. Reference: docs/configuration.md.
"""


def render(all_active: bool = False) -> str:
    """The policy file `sluice init` writes. `all_active=True` writes the same lines with nothing commented out
    (every default spelled out), which tests load to check the listed defaults."""
    settings = read_policy_file(EMBEDDED_POLICY)
    lines = HEADER.splitlines()
    for name in file_fields(Policy):
        lines.append("")
        lines += _field(Policy, name, _default_of(Policy, name), settings, 0, all_active)
    return "\n".join(lines) + "\n"


def _default_of(cls: type, name: str) -> Any:
    f = file_fields(cls)[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None  # a required field (e.g. a lane's name): only written from the built-in policy's values


def _item_class(cls: type, name: str) -> type | None:
    """The dataclass of a `list[SomeDataclass]` field (pools, lanes), else None."""
    tp = typing.get_type_hints(cls)[name]
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _doc(cls: type, name: str, indent: int) -> list[str]:
    text = field_docs(cls).get(name, "")
    pad = " " * indent + "# "
    return textwrap.wrap(text, WIDTH, initial_indent=pad, subsequent_indent=pad) if text else []


def _mark(line: str, indent: int, active: bool) -> str:
    """`line` (already indented) commented out at column `indent` unless active."""
    return line if active else line[:indent] + "# " + line[indent:]


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).removesuffix("\n...\n").strip()


def _field(cls: type, name: str, default: Any, settings: dict[str, Any], indent: int, all_active: bool,
           with_doc: bool = True) -> list[str]:
    """The lines of one field: its description, then `name: value`, or `name:` and its nested lines. A commented
    out section or list is written as one block commented at its own column: its lines are rendered active and
    marked together, so uncommenting the block gives valid YAML."""
    pad = " " * indent
    active = all_active or name in settings
    out = _doc(cls, name, indent) if with_doc else []
    tp = typing.get_type_hints(cls)[name]
    item_cls = _item_class(cls, name)
    value = settings[name] if name in settings else default
    block: list[str] = []
    if dataclasses.is_dataclass(tp):
        for child in file_fields(tp):
            block += _field(tp, child, _default_of(tp, child), settings.get(name) or {}, indent + 2,
                            all_active or not active)
    elif item_cls is not None and value:
        for i, item in enumerate(to_dict(value)):
            block += _list_item(item_cls, item if name in settings else {}, item, indent + 2,
                                all_active or not active, first=i == 0)
    elif isinstance(value, (list, tuple)) and value:
        block = [f"{pad}  - {_scalar(v)}" for v in to_dict(value)]
    elif isinstance(value, dict) and value:
        block = [f"{pad}  {k}: {_scalar(v)}" for k, v in to_dict(value).items()]
    else:
        return out + [_mark(f"{pad}{name}: {_scalar(to_dict(value))}", indent, active)]
    return out + [_mark(line, indent, active) for line in [f"{pad}{name}:", *block]]


def _list_item(cls: type, settings: dict[str, Any], values: dict[str, Any], indent: int, all_active: bool,
               first: bool) -> list[str]:
    """One `- ...` entry of a list of sections (a pool, a lane). Its set fields come first, so that the `- `
    sits on an active line; the descriptions are written on the list's first entry only."""
    names = sorted(file_fields(cls), key=lambda n: n not in settings and not all_active)
    out: list[str] = []
    for k, name in enumerate(names):
        default = values.get(name, _default_of(cls, name))
        lines = _field(cls, name, default, settings, indent + 2, all_active, with_doc=first)
        if k == 0:
            at = len(_doc(cls, name, indent + 2)) if first else 0
            lines[at] = " " * indent + "- " + lines[at][indent + 2:]
        out += lines
    return out
