"""One configuration model per flow (`flows`), on a shared base (`base`): each field's type, default, help and
check written once. Callers import the names below from `imgest.config`."""

from imgest.config.base import ConfigError, FlowConfig, build, describe
from imgest.config.flows import (
    CONFIGS,
    Cli,
    DuplicatesConfig,
    EncodeConfig,
    EvalConfig,
    IndexConfig,
    IngestConfig,
    MigrateConfig,
    NightlyConfig,
    ReencodeConfig,
    SyncConfig,
)
from imgest.config.heads import HeadConfig, TrainHeadConfig

__all__ = ["CONFIGS", "Cli", "ConfigError", "DuplicatesConfig", "EncodeConfig", "EvalConfig", "FlowConfig",
           "HeadConfig", "IndexConfig", "IngestConfig", "MigrateConfig", "NightlyConfig", "ReencodeConfig",
           "SyncConfig", "TrainHeadConfig", "build", "describe"]
