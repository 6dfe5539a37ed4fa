"""Typed, validated configuration of each flow; bad values fail before any work starts."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tasks.decode import DEFAULT_MAX_PIXELS

DEFAULT_SHARD_SIZE = 2000


class ConfigError(ValueError):
    """A parameter is out of range; the message names it and says what is allowed."""


def parse_batch_size(value: str | int) -> int | None:
    """'auto' -> None (measure); a positive integer -> itself."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"batch_size must be 'auto' or a positive integer, got {value!r}") from None
    if size < 1:
        raise ConfigError(f"batch_size must be 'auto' or a positive integer, got {value!r}")
    return size


RUNNERS = "local, dask, or a Dask scheduler address (tcp://host:8786, tls://...)"


def check_runner(runner: str, workers: int) -> None:
    if runner not in ("local", "dask") and not runner.startswith(("tcp://", "tls://", "ucx://")):
        raise ConfigError(f"runner must be {RUNNERS}; got {runner!r}")
    if not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers must be an integer >= 0 (0: one per CPU core); got {workers!r}")
    if runner != "dask" and workers:
        raise ConfigError("workers sets the size of a local Dask cluster: use it with runner 'dask'")


@dataclass(frozen=True)
class IngestConfig:
    catalogue: str
    store: str
    model: str = "efficientnet-lite0"
    batch_size: str = "auto"
    device: str = "auto"
    shard_size: int = DEFAULT_SHARD_SIZE
    decode_workers: int = 2
    max_pixels: int = DEFAULT_MAX_PIXELS
    runner: str = "local"
    workers: int = 0
    encode_limit: str = "auto"

    def __post_init__(self) -> None:
        check_runner(self.runner, self.workers)
        if not re.fullmatch(r"[A-Za-z0-9._:-]+", str(self.encode_limit)):
            raise ConfigError("encode_limit must be 'auto' (one encode per GPU), 'none' or the name of a Prefect "
                              f"global concurrency limit (letters, digits, . _ : -); got {self.encode_limit!r}")
        for name in ("catalogue", "store", "model"):
            if not str(getattr(self, name)).strip():
                raise ConfigError(f"{name} must not be empty")
        parse_batch_size(self.batch_size)
        for name, low in (("shard_size", 1), ("decode_workers", 1), ("max_pixels", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be one of auto, cpu, cuda, cuda:N; got {self.device!r}")

    @property
    def fixed_batch_size(self) -> int | None:
        return parse_batch_size(self.batch_size)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class IndexConfig:
    store: str
    model: str = "efficientnet-lite0"
    kind: str = "auto"
    memory: str = "4G"
    target_recall: float = 0.95
    k: int = 10
    queries: int = 1000
    alias: str | None = "auto"  # follow: move the aliases already on this model; create `serving` if none
    parts: int = 1  # >1: train once here, add that many slices in parallel on `runner`, merge
    runner: str = "local"
    workers: int = 0

    def __post_init__(self) -> None:
        check_runner(self.runner, self.workers)
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ConfigError(f"parts must be an integer >= 1 (1: build in one process); got {self.parts!r}")
        from tasks.index_choice import KINDS, IndexChoiceError, parse_memory

        if self.kind not in KINDS and not any(t in self.kind for t in ("Flat", "HNSW", "IVF", "PQ", "SQ")):
            raise ConfigError(f"kind must be one of {', '.join(KINDS)} or a faiss factory string; got {self.kind!r}")
        try:
            parse_memory(self.memory)
        except IndexChoiceError as exc:
            raise ConfigError(str(exc)) from None
        if not 0 < self.target_recall <= 1:
            raise ConfigError(f"target_recall must be in (0, 1]; got {self.target_recall}")
        for name in ("k", "queries"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1; got {getattr(self, name)!r}")
        if self.alias not in (None, "auto"):
            from tasks.index_store import ALIAS_NAME

            if not ALIAS_NAME.match(self.alias):
                raise ConfigError(f"alias must be lowercase letters, digits, '-' or '_'; got {self.alias!r}")
