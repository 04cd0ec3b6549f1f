"""A logger that keeps what it is given, for tests that read logged figures."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import Logger


class Recorder(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step or 0, dict(metrics)))

    def last(self, key: str) -> float | None:
        values = [row[key] for _, row in self.rows if key in row]
        return values[-1] if values else None
