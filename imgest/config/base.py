"""The machinery under every flow's configuration model: frozen models that refuse unknown fields, and a bad
value turned into one line naming the field and what is allowed (`ConfigError`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from imgest.errors import UserError


class ConfigError(UserError, ValueError):
    """A parameter is out of range; the message names it and says what is allowed."""


def describe(exc: ValidationError) -> str:
    """A model's validation errors as one line: 'memory must look like 4G, ...; shard_size: ...'."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        parts.append(message if not where or message.startswith(where.rsplit(".", 1)[-1]) else f"{where}: {message}")
    return "; ".join(parts)


def build(model: type[BaseModel], values: dict) -> BaseModel:
    """The model from plain values, a bad one raising ConfigError with describe()'s one line."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None


class FlowConfig(BaseModel):
    """Frozen, no unknown fields: a misspelt parameter fails instead of being ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    def to_dict(self) -> dict:
        return self.model_dump()
