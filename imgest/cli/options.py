"""Command options derived from a flow's configuration model: a field's flag, type, default and help come from
the model, so a field added there is an option here with nothing else to edit.

typer reads a command's options from its signature; `config_command` writes that signature from the model's
fields (a nested model's fields flattened: train-head's `training.loss` is `--loss`) followed by the command's
own options (`--json`), and hands the command the validated model. typer has no pydantic support of its own,
and moving every command to pydantic-settings' or cyclopts' CLI would change flags other tools depend on; this
keeps typer's commands and their flags, and takes from the model what typer needs.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from imgest.config import Cli, ConfigError, build


@dataclass(frozen=True)
class CliField:
    """One model field as a command option."""

    name: str  # the command's parameter name
    path: tuple[str, ...]  # where the value goes in the model: ("training", "loss")
    flag: str
    annotation: Any
    default: Any
    help: str | None


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _cli_type(annotation: Any) -> Any:
    """typer's spelling of a field's type: `str | None` -> Optional[str]."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return Optional[inner[0]] if len(inner) == 1 else Optional[str]  # noqa: UP045 (typer reads Optional)
    return annotation


def cli_fields(model: type[BaseModel], exclude: tuple[str, ...] = (),
               path: tuple[str, ...] = ()) -> Iterator[CliField]:
    """The options a model's fields make, nested models flattened; `exclude`: fields a command does not take."""
    for name, info in model.model_fields.items():
        if name in exclude:
            continue
        if _is_model(info.annotation):
            yield from cli_fields(info.annotation, exclude, (*path, name))
            continue
        yield _field(name, info, (*path, name))


def _field(name: str, info: FieldInfo, path: tuple[str, ...]) -> CliField:
    cli = next((m for m in info.metadata if isinstance(m, Cli)), None)
    flag = cli.flag if cli else "--" + name.replace("_", "-")
    annotation = cli.type if cli and cli.type else _cli_type(info.annotation)
    default = ... if info.is_required() else info.default
    if cli and cli.type is str and isinstance(default, tuple):
        default = ",".join(map(str, default))  # `--k 1,5,10`: the model parses the string
    return CliField(flag[2:].replace("-", "_"), path, flag, annotation, default, info.description)


def config_command(model: type[BaseModel], *, only: tuple[str, ...] | None = None, exclude: tuple[str, ...] = (),
                   fixed: dict[str, Any] | None = None) -> Callable:
    """Decorate a typer command `def cmd(config: Model, <own options>)`: its options are the model's fields
    (`only` those, less `exclude` and the `fixed` values the command sets itself), then its own; a bad value
    exits 2 with one line naming the field."""
    fixed = fixed or {}

    def wrap(fn: Callable) -> Callable:
        fields = [f for f in cli_fields(model, exclude=exclude + tuple(fixed))
                  if only is None or f.path[0] in only]
        own = list(inspect.signature(fn).parameters.values())[1:]
        hints = typing.get_type_hints(fn)

        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            from imgest.cli.app import fail

            config: dict[str, Any] = dict(fixed)
            for field in (f for f in fields if f.name in values):  # absent: called from Python, model default
                target = config
                for part in field.path[:-1]:
                    target = target.setdefault(part, {})
                target[field.path[-1]] = values[field.name]
            try:
                built = build(model, config)
            except ConfigError as exc:
                fail(exc)
            return fn(built, **{p.name: values[p.name] for p in own})

        params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.annotation,
                                    default=typer.Option(f.default, f.flag, help=f.help)) for f in fields]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
                   for p in own]
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the signature written here, not the function's own
        return command

    return wrap
