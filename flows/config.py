"""Typed, validated configuration of each flow; bad values fail before any work starts."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
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
