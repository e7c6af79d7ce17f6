"""Env families: the built-in ones, those registered from Python, and classes named by import path.

An env family is an env class and, optionally, its config model (a pydantic model). The config's
``env`` section names it (docs/custom-env.md):

* a built-in family by its name (``env.name: plan_path``), its keys directly under ``env``
  (``env.grid_size``): :data:`BUILTIN_ENVS` lists them, and that one tuple is the source of the
  registry (:data:`ENV_REGISTRY`), of the ``env`` section's config union (:data:`EnvConfig`)
  and of the reference (docs/config.md);
* your own env class by its import path, ``env.name: package.module:ClassName``, or by a name
  given to :func:`register_env` in this process; its settings go under ``env.kwargs``
  (:class:`PluginEnvConfig`).

The convention for an env class (built-in or yours): a class attribute ``config_class``, a
pydantic model, validates the settings, and the env is built as ``EnvClass(config)`` with the
validated model. A class without ``config_class`` is built as ``EnvClass(**kwargs)``, its
keyword names checked against its signature when the config is loaded. Every mistake is caught
when the config is loaded, in one line that names the key (``env.name`` or ``env.kwargs.<key>``).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeAlias, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_validator,
)

from atgrpo.envs.base import MultiAgentEnv, env_call, import_user_module
from atgrpo.envs.code import CodeEnv
from atgrpo.envs.dataset import DatasetEnv
from atgrpo.envs.math import MathEnv
from atgrpo.envs.plan_path import PlanPathEnv
from atgrpo.envs.sokoban import SokobanEnv
from atgrpo.envs.sudoku import SudokuEnv
from atgrpo.envs.textarena import TextArenaEnv  # imports textarena only when one is configured

DEFAULT_ENV = "plan_path"  # the family of an env section that names none
PLUGIN_TAG = "plugin"  # the union's tag of every env that is not built in
# What a class needs to be taken for an env (the rest of MultiAgentEnv is set by __init__).
ENV_METHODS = ("reset", "observe", "step", "clone", "done", "success")
_REGISTERED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class EnvSpecError(ValueError):
    """A bad ``env`` section; the message is one whole line that names the key to fix."""


@dataclass(frozen=True)
class EnvFamily:
    """An env class and the config model its settings are validated by (None: keyword args)."""

    name: str  # the built-in or registered name, or the import path "package.module:Class"
    env_class: type
    config_class: type[BaseModel] | None

    def make(self, config: Any) -> MultiAgentEnv:
        """A new (not yet reset) env: ``env_class(config)``, or ``env_class(**config)``; an
        exception of the class's ``__init__`` is an :class:`~atgrpo.envs.base.EnvError`."""
        with env_call(self.env_class, "__init__"):
            if self.config_class is None:
                env: MultiAgentEnv = self.env_class(**config)
            else:
                env = self.env_class(config)
        return env

    def validate(self, settings: Mapping[str, Any], key: str) -> Any:
        """``settings`` (the mapping under ``key``) as this family's env takes them: a
        validated config model, or the keyword arguments, checked against the signature."""
        if self.config_class is not None:
            try:
                return self.config_class.model_validate(dict(settings))
            except ValidationError as err:
                raise EnvSpecError(_settings_error(err, self.config_class, key)) from None
        _check_keywords(self.env_class, settings, key)
        return dict(settings)

    @property
    def label(self) -> str:
        return f"{self.env_class.__module__}.{self.env_class.__qualname__}"


def _family_of(env_class: type) -> EnvFamily:
    """A built-in family: the name is its config model's ``name`` literal."""
    config_class = env_class.config_class  # type: ignore[attr-defined]
    return EnvFamily(config_class.model_fields["name"].default, env_class, config_class)


# The built-in env families, in the order of docs/config.md; the only list of them.
BUILTIN_ENVS: tuple[EnvFamily, ...] = tuple(
    _family_of(cls)
    for cls in (PlanPathEnv, SokobanEnv, SudokuEnv, CodeEnv, MathEnv, DatasetEnv, TextArenaEnv)
)
# Name -> family: the built-in ones and those of register_env.
ENV_REGISTRY: dict[str, EnvFamily] = {family.name: family for family in BUILTIN_ENVS}


def builtin_names() -> tuple[str, ...]:
    return tuple(family.name for family in BUILTIN_ENVS)


def register_env(
    name: str, env_class: type, config_class: type[BaseModel] | None = None
) -> EnvFamily:
    """Make ``env.name: <name>`` build ``env_class`` in this process (settings under
    ``env.kwargs``, validated by ``config_class``, default ``env_class.config_class``).

    A name registered in a process is unknown to others (``atgrpo compare --train`` starts one
    ``atgrpo train`` per run): a config file names a class by its import path instead. Registering
    a name again replaces the entry only with a class of the same module and name (a module
    reloaded in a notebook); a built-in name or another class's name is refused.
    """
    if not isinstance(name, str) or not _REGISTERED_NAME.match(name):
        raise ValueError(
            f"register_env: {name!r} is not an env name (a letter or '_', then letters, digits, "
            "'_', '.', '-'; a ':' is for import paths)"
        )
    if name in builtin_names():
        raise ValueError(f"register_env: {name!r} is a built-in env; register yours under another")
    if problem := _not_an_env(env_class):
        raise TypeError(f"register_env: {name!r}: {env_class!r} {problem}")
    declared = getattr(env_class, "config_class", None)
    if config_class is not None and declared is not None and config_class is not declared:
        raise ValueError(
            f"register_env: {name!r}: config_class {config_class.__name__} differs from "
            f"{env_class.__name__}.config_class ({declared.__name__}); pass one of them"
        )
    if config_class is not None and not (
        inspect.isclass(config_class) and issubclass(config_class, BaseModel)
    ):
        raise TypeError(f"register_env: {name!r}: config_class must be a pydantic model")
    family = EnvFamily(name, env_class, config_class or declared)
    old = ENV_REGISTRY.get(name)
    if old is not None and old.label != family.label:
        raise ValueError(
            f"register_env: {name!r} is already registered to {old.label}; choose another name"
        )
    ENV_REGISTRY[name] = family
    return family


def resolve_env(name: str) -> EnvFamily:
    """The family ``env.name`` names: built-in, registered, or ``package.module:ClassName``
    (imported from ``sys.path``, then the working directory). Raises :class:`EnvSpecError`."""
    if name in ENV_REGISTRY:
        return ENV_REGISTRY[name]
    if ":" not in name:
        raise EnvSpecError(_unknown_name(name))
    if not _IMPORT_PATH.match(name):
        raise EnvSpecError(
            f"invalid value for 'env.name': {name!r} is not an import path; name your env "
            "class as 'package.module:ClassName'"
        )
    module_name, _, class_path = name.partition(":")
    module = _import(module_name)
    env_class: Any = module
    for part in class_path.split("."):
        if not hasattr(env_class, part):
            raise EnvSpecError(_missing_class(module, module_name, class_path))
        env_class = getattr(env_class, part)
    if problem := _not_an_env(env_class):
        raise EnvSpecError(f"invalid value for 'env.name': {name!r} {problem}")
    return EnvFamily(name, env_class, getattr(env_class, "config_class", None))


def _unknown_name(name: str) -> str:
    known = sorted(ENV_REGISTRY)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"invalid value for 'env.name': unknown env {name!r}{hint}; known: {', '.join(known)}; "
        "an env class of your own is named as 'package.module:ClassName' (docs/custom-env.md)"
    )


def _import(module_name: str) -> Any:
    """:func:`atgrpo.envs.base.import_user_module`, its error as the config's ``env.name``."""
    try:
        return import_user_module(module_name)
    except ValueError as exc:
        raise EnvSpecError(f"invalid value for 'env.name': {exc}") from None


def _missing_class(module: Any, module_name: str, class_path: str) -> str:
    classes = [n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_")]
    close = difflib.get_close_matches(class_path, classes, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"invalid value for 'env.name': module {module_name!r} has no {class_path!r}{hint}"


def _not_an_env(env_class: Any) -> str | None:
    """Why ``env_class`` cannot be an env class, or None."""
    if not inspect.isclass(env_class):
        return f"is a {type(env_class).__name__}, not a class"
    if lacks := [m for m in ENV_METHODS if not hasattr(env_class, m)]:
        return (
            f"is not an env class: it lacks {', '.join(lacks)} (subclass "
            "atgrpo.envs.TurnBasedEnv; docs/custom-env.md)"
        )
    config_class = getattr(env_class, "config_class", None)
    if config_class is not None and not (
        inspect.isclass(config_class) and issubclass(config_class, BaseModel)
    ):
        return f"has a config_class {config_class!r} that is not a pydantic model"
    return None


def _settings_error(err: ValidationError, model: type[BaseModel], key: str) -> str:
    """The first error of validating the settings under ``key``, as one line naming its key."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
    full = f"{key}.{loc}" if loc else key
    if first["type"] == "extra_forbidden":
        known = [f"{key}.{f}" for f in model.model_fields]
        close = difflib.get_close_matches(full, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown config key {full!r}{hint}"
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a section"
    return f"invalid value for {full!r}: {first['msg']} (got {shown})"


def _check_keywords(env_class: type, settings: Mapping[str, Any], key: str) -> None:
    """The keyword arguments ``settings`` fit ``env_class(**settings)``'s signature."""
    try:
        signature = inspect.signature(env_class)
    except (TypeError, ValueError):
        return  # a class whose signature Python cannot read: the call itself will tell
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for given in settings:
        if given not in names:
            close = difflib.get_close_matches(given, names, n=1)
            hint = f" (did you mean {key + '.' + close[0]!r}?)" if close else ""
            takes = ", ".join(names) or "no settings"
            raise EnvSpecError(
                f"unknown config key {key + '.' + given!r}{hint}; {env_class.__name__} takes: "
                f"{takes}"
            )
    for p in params:
        if p.name in names and p.default is p.empty and p.name not in settings:
            raise EnvSpecError(
                f"missing config key {key + '.' + p.name!r}: {env_class.__name__} requires it"
            )


class PluginEnvConfig(BaseModel):
    """The ``env`` section of an env that is not built in: its name and its settings.

    ``name`` is ``package.module:ClassName`` or a name given to :func:`register_env`;
    ``kwargs`` are validated by the class's ``config_class`` when it declares one (and written
    back in full, defaults included, so a dumped config reloads to the same settings), else
    checked against its signature.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="'package.module:ClassName' (imported from sys.path, then the working "
        "directory) or a name given to atgrpo.register_env in this process."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The env's settings: validated by its config_class when it declares one, "
        "else passed to the class as keyword arguments.",
    )
    _family: EnvFamily | None = PrivateAttr(None)
    _settings: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve(self) -> PluginEnvConfig:
        family = resolve_env(self.name)
        settings = family.validate(self.kwargs, "env.kwargs")
        if isinstance(settings, BaseModel):
            self.kwargs = settings.model_dump(mode="json")
        self._family, self._settings = family, settings
        return self

    @property
    def family(self) -> EnvFamily:
        assert self._family is not None  # set by validation
        return self._family

    @property
    def settings(self) -> Any:
        """The validated config model (or the keyword arguments) the env is built with."""
        return self._settings

    def make(self) -> MultiAgentEnv:
        return self.family.make(self._settings)


class EnvSection(Protocol):
    """What every ``env`` section has (statically; at run time it is one of the union)."""

    @property
    def name(self) -> str: ...


def env_tag(value: Any) -> str:
    """The union member of an ``env`` section: its built-in family, else the plug-in one."""
    if isinstance(value, dict):
        name = value.get("name", DEFAULT_ENV)
    elif isinstance(value, BaseModel):
        name = getattr(value, "name", None)
    else:
        return PLUGIN_TAG  # not a mapping: PluginEnvConfig says so
    return name if name in builtin_names() else PLUGIN_TAG


def _config_union() -> Any:
    members = [Annotated[f.config_class, Tag(f.name)] for f in BUILTIN_ENVS]
    members.append(Annotated[PluginEnvConfig, Tag(PLUGIN_TAG)])
    return Annotated[Union[tuple(members)], Discriminator(env_tag)]  # noqa: UP007


if TYPE_CHECKING:
    EnvConfig: TypeAlias = EnvSection
else:
    # The `env` config section: a built-in family's config, chosen by `name`, or a plug-in.
    EnvConfig = _config_union()


def make_env(cfg: EnvSection) -> MultiAgentEnv:
    """A new (not yet reset) env for the ``env`` section ``cfg``."""
    if isinstance(cfg, PluginEnvConfig):
        return cfg.make()
    family = ENV_REGISTRY.get(cfg.name)
    if family is None:
        raise ValueError(_unknown_name(cfg.name))
    return family.make(cfg)
