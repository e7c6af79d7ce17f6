"""The config reference (docs/config.md), generated from the config models.

Every key of :class:`~atgrpo.config.Config` and of every built-in env family, with its type,
default and description, as Markdown tables; ``atgrpo config --describe [SECTION]`` prints it
(the whole file, or one section), and a test checks that the committed file is current.
Regenerate it with ``.venv/bin/atgrpo config --describe > docs/config.md``.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from atgrpo.config import Config, ConfigError
from atgrpo.envs import BUILTIN_ENVS, PluginEnvConfig, resolve_env

REGENERATE = ".venv/bin/atgrpo config --describe > docs/config.md"
HEADER = f"""# Config reference

<!-- Generated from the config models by atgrpo.config_docs; do not edit by hand.
     Regenerate: {REGENERATE} -->

Every key of a config, with its type, default and meaning. A config is a YAML file of these
sections plus `section.key=value` overrides on the command line
(`atgrpo train configs/demo.yaml train.steps=5`); an unknown key or an invalid value fails at
load time naming the key. `atgrpo config --describe SECTION` prints one section of this page.
"""
ENV_INTRO = """`env.name` chooses the env family. A built-in family takes its keys beside the name
(`env.grid_size`); an env class of your own is named by its import path and takes its settings
under `env.kwargs`, validated by its `config_class` (docs/custom-env.md)."""
PLUGIN_TITLE = "env: your own env class"
REQUIRED = "required"  # the default column of a key without a default


@dataclass
class Table:
    """One Markdown table: the keys of one section (``title``), in the model's field order."""

    title: str
    about: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # key, type, default, text

    def markdown(self, level: int) -> str:
        lines = [f"{'#' * level} {_text(self.title)}", ""]
        if self.about:
            lines += [self.about, ""]
        if self.rows:
            lines += ["| key | type | default | description |", "|---|---|---|---|", ""]
            lines[-1:] = ["| " + " | ".join(_cells(*row)) + " |" for row in self.rows]
        return "\n".join(lines).rstrip("\n") + "\n"


def _cells(key: str, kind: str, default: str, text: str) -> tuple[str, str, str, str]:
    return (
        _code(key),
        _text(kind),
        default if default == REQUIRED else _code(default),
        _text(text),
    )


def describe(section: str | None = None) -> str:
    """The reference as Markdown: the whole page (docs/config.md), or one ``section``: a key of
    the config (``rollout``), a built-in env family (``env.math``) or an env class of your own
    (``package.module:ClassName``: its ``env.kwargs``)."""
    if section is None:
        return "\n".join([HEADER, *(describe(name) for name in Config.model_fields)])
    return "\n".join(table.markdown(level) for level, table in _section_tables(section))


Leveled = list[tuple[int, Table]]  # (heading level, table), a section before its sub-sections


def _section_tables(section: str) -> Leveled:
    families = {f.name: f for f in BUILTIN_ENVS}
    if section == "env":
        tables: Leveled = [(2, Table("env", ENV_INTRO))]
        for name in families:
            tables += _section_tables(f"env.{name}")
        return [*tables, (3, _plugin_table())]
    if section.startswith("env.") and section[4:] in families:
        model = families[section[4:]].config_class
        assert model is not None  # every built-in env has its config model
        return _tables(model, "env.", f"env.name: {section[4:]}", 3)
    if ":" in section:
        return [(3, _kwargs_table(section))]
    if section in Config.model_fields:
        info = Config.model_fields[section]
        inner = _section_model(info.annotation)
        if inner is None:  # a plain mapping (routing)
            return [(2, Table(section, "", [_row(section, info)]))]
        model, keyed = inner
        title = f"{section}.<id>" if keyed else section
        head = [(2, Table(section, "", [_row(section, info)]))] if keyed else []
        return head + _tables(model, f"{title}.", title, 3 if keyed else 2)
    names = ", ".join(f"env.{name}" for name in families)
    raise ConfigError(
        f"--describe {section!r}: no such section; sections: {', '.join(Config.model_fields)}, "
        f"an env family ({names}) or an env class 'package.module:ClassName'"
    )


def _plugin_table() -> Table:
    table = Table(PLUGIN_TITLE, _doc(PluginEnvConfig))
    for name, info in PluginEnvConfig.model_fields.items():
        table.rows.append(_row(f"env.{name}", info))
    return table


def _kwargs_table(import_path: str) -> Table:
    """The ``env.kwargs`` of an env class named by its import path."""
    try:
        family = resolve_env(import_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    title = f"env.name: {import_path}"
    model = family.config_class
    if model is None:
        table = Table(title, "Keyword arguments of the class (it declares no config_class).")
        for p in inspect.signature(family.env_class).parameters.values():
            default = REQUIRED if p.default is p.empty else _show(p.default)
            table.rows.append((f"env.kwargs.{p.name}", "", default, ""))
        return table
    table = Table(title, _doc(model))
    for name, info in model.model_fields.items():
        table.rows.append(_row(f"env.kwargs.{name}", info))
    return table


def _tables(model: type[BaseModel], prefix: str, title: str, level: int) -> Leveled:
    """The table of ``model``'s keys (under ``prefix``), then those of its nested sections."""
    table = Table(title, _doc(model))
    nested: Leveled = []
    for name, info in model.model_fields.items():
        key = prefix + name
        table.rows.append(_row(key, info))
        if (inner := _section_model(info.annotation)) is not None:
            sub = f"{key}.<id>" if inner[1] else key
            nested += _tables(inner[0], f"{sub}.", sub, level + 1)
    return [(level, table), *nested]


def _section_model(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """(the model, whether keyed by an id) of a section field: ``Model``, ``Model | None`` or
    ``dict[str, Model]``; None for a plain value."""
    if _is_model(annotation):
        return annotation, False
    args = [a for a in get_args(annotation) if a is not type(None)]
    if _is_union(annotation) and len(args) == 1 and _is_model(args[0]):
        return args[0], False
    if get_origin(annotation) is dict and len(args) == 2 and _is_model(args[1]):
        return args[1], True
    return None


def _row(key: str, info: FieldInfo) -> tuple[str, str, str, str]:
    annotation = info.annotation
    if key == "env.name" and get_origin(annotation) is Literal:
        return (key, _type_name(annotation), _show(get_args(annotation)[0]), "The env family.")
    text = info.description or ""
    section = _section_model(annotation)
    if section is not None and not text:
        text = _doc(section[0])
    return (key, _type_name(annotation), _default(info), text)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return REQUIRED
    else:
        value = info.default
    if isinstance(value, BaseModel) and _is_model(info.annotation):
        return ""  # a section: its keys have their own rows
    assert info.annotation is not None  # every config field is annotated
    dumped = TypeAdapter(info.annotation).dump_python(value, mode="json", exclude_defaults=True)
    return _show(dumped)


def _show(value: Any) -> str:
    """A value as it is written in YAML, on one line."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str) and not value.isprintable():
        return json.dumps(value)  # "```python\n": the escapes, as YAML reads them too
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if _is_model(annotation):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " / ".join(str(m.value) for m in annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " / ".join(_show(a) for a in args)
    if _is_union(annotation):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {_type_name(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return f"mapping {_type_name(args[0])} -> {_type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _doc(model: type[BaseModel]) -> str:
    """The first paragraph of a model's own docstring, on one line ("" for none)."""
    doc = model.__dict__.get("__doc__") or ""
    first = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    return _markdown(first)


def _code(text: str) -> str:
    """``text`` as a code span ("" stays empty); one with a backtick gets double ones."""
    if not text:
        return ""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`PuzzleConfig` -> `PuzzleConfig`
_RST_LITERAL = re.compile(r"``([^`]+)``")  # ``run.name`` -> `run.name`
_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # what Markdown would take for an HTML tag


def _markdown(text: str) -> str:
    """rST roles and literals of a docstring as Markdown code spans."""
    return _RST_LITERAL.sub(r"`\1`", _RST_ROLE.sub(r"`\1`", text))


def _text(text: str) -> str:
    """Docstring or description text for a Markdown cell: one line, no pipes, no brackets that
    read as HTML tags."""
    text = _markdown(text).replace("|", "\\|").replace("\n", " ")
    return _TAG_START.sub(r"\\<", text)
