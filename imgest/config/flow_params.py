"""Flows whose one parameter is their configuration model, and deployments made before that still run.

A deployment created by an earlier imgest passes each field as a flat parameter (`catalogue`, `store`, ...).
Prefect would refuse those before the flow starts; here they are gathered into `config` (training fields of
train-head into `config.training`) and the run goes on, with a warning saying where each one moved and that
a redeploy (`imgest serve`, or `prefect deploy --all`) makes the warning go away.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from prefect import Flow
from pydantic import BaseModel

logger = logging.getLogger("imgest.flows")


def config_model(fn) -> type[BaseModel]:
    """The model a flow function takes as `config`."""
    annotation = inspect.signature(fn, eval_str=True).parameters["config"].annotation
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        raise TypeError(f"{fn.__name__}: `config` must be annotated with its configuration model")
    return annotation


def nested_fields(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the nested model field holding it ({"loss": "training", ...} for train-head)."""
    out = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out.update({inner: name for inner in info.annotation.model_fields})
    return out


def gather_flat(model: type[BaseModel], parameters: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Flat parameters of an earlier deployment -> {"config": {...}} and the moves made ("store -> config.store")."""
    nested = nested_fields(model)
    flat = {k: v for k, v in parameters.items() if k != "config"}
    unknown = sorted(set(flat) - set(model.model_fields) - set(nested))
    if not flat or unknown:
        return parameters, []  # nothing to move, or names no version had: Prefect's own error names them
    config = dict(parameters.get("config") or {})
    moves = []
    for name, value in flat.items():
        if name in model.model_fields:
            config[name] = value
            moves.append(f"{name} -> config.{name}")
        else:
            config.setdefault(nested[name], {})[name] = value
            moves.append(f"{name} -> config.{nested[name]}.{name}")
    return {"config": config}, moves


class ConfiguredFlow(Flow):
    """A Prefect flow taking `config: <model>`; flat parameters of earlier deployments are moved into it."""

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        parameters, moves = gather_flat(config_model(self.fn), parameters)
        if moves:
            logger.warning("flow %s: parameters of an earlier deployment moved into its configuration (%s); "
                           "redeploy (imgest serve, or prefect deploy --all) to set them there",
                           self.name, ", ".join(moves))
        return super().validate_parameters(parameters)


def configured_flow(**options):
    """`@configured_flow(name=...)`: prefect's `@flow(...)` for a function taking its configuration model."""
    def wrap(fn) -> ConfiguredFlow:
        config_model(fn)  # refuse a flow without a model at import, not at its first run
        return ConfiguredFlow(fn=fn, validate_parameters=True, **options)
    return wrap
