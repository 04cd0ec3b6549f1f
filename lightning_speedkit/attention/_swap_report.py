"""A report of what :func:`~lightning_speedkit.swap_attention` did, module by module."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from lightning_speedkit.attention._swapped_forward import _SwappedForward

Status = Literal["pending", "active", "reverted"]


@dataclass
class ModuleSwap:
    """One swapped attention module, as checked so far."""

    name: str
    family: str
    requested: str
    backend: str | None = None
    """The backend that runs (``auto``'s pick; a fallback says so)."""
    status: Status = "pending"
    parity_error: float | None = None
    """Largest relative error over outputs and gradients in the latest check."""
    speedup: float | None = None
    """Own forward(+backward) time / fused time, on the checked inputs."""
    checked: str = ""
    """What the latest passed check covered: ``synthetic``, ``forward`` or ``forward+backward``."""
    reason: str = ""
    """Why it was reverted."""
    packed_backend: str | None = None
    """Where ``auto`` kept the own forward as faster: the backend that still runs packed
    batches (the own forward would attend across their documents)."""
    detail: str = ""
    """What discovery saw in the module (``traced`` family): heads, projections, masks."""
    ranks: str = ""
    """On rank 0, once the ranks agreed: what other ranks had decided for this module."""


@dataclass
class SwapReport:
    """What :func:`swap_attention` did; entries update as modules are checked."""

    backend: str
    modules: list[ModuleSwap] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Modules of a known family that cannot be swapped, with the reason."""
    _swaps: dict[str, _SwappedForward] = field(default_factory=dict, repr=False, compare=False)
    _decided: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    """Decisions for modules not found yet (a resumed run's, for traced modules)."""
    _auto_picks: dict[Hashable, tuple[str, float | None]] = field(
        default_factory=dict, repr=False, compare=False
    )
    """``auto``'s pick (backend, speedup) for each kind of call: one timing per kind."""

    @property
    def swapped(self) -> list[str]:
        """Names of the modules whose attention now runs the fused backend."""
        return [m.name for m in self.modules if m.status != "reverted"]

    @property
    def reverted(self) -> list[tuple[str, str]]:
        """Modules that failed their parity check, with the reason; they run their own forward."""
        return [(m.name, m.reason) for m in self.modules if m.status == "reverted"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "modules": [asdict(m) for m in self.modules],
            "skipped": [list(pair) for pair in self.skipped],
        }

    def to_markdown(self) -> str:
        lines = [
            "| module | family | backend | status | parity error | speedup | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in self.modules:
            error = "-" if m.parity_error is None else f"{m.parity_error:.1e}"
            speedup = "-" if m.speedup is None else f"{m.speedup:.2f}x"
            note = m.reason or (f"checked: {m.checked}" if m.checked else "not called yet")
            note = "; ".join(part for part in (note, m.detail, m.ranks) if part)
            lines.append(
                f"| {m.name or '(root)'} | {m.family} | {m.backend or m.requested} | {m.status} "
                f"| {error} | {speedup} | {note} |"
            )
        for name, reason in self.skipped:
            lines.append(f"| {name or '(root)'} | - | - | skipped | - | - | {reason} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()
