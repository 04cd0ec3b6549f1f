"""The ranks' agreement: every rank runs rank 0's decisions for its swapped modules.

Each rank checks and times its swaps on its own inputs, so ranks can decide
differently (a parity error near the tolerance, ``auto``'s timings). :func:`agree`
gathers every rank's decisions (one all-gather, passed in), makes each rank apply
rank 0's, and notes on rank 0 what the other ranks had decided. The collective is
an argument: :func:`~lightning_speedkit.attention.swap.agree_across_ranks` passes
``torch.distributed``'s, a test a function that fills in other ranks' decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit.attention._swap_report import ModuleSwap, SwapReport

AllGather = Callable[[list[Any], Any], None]
"""``torch.distributed.all_gather_object``'s shape: fills the list with every rank's object."""


def decision(entry: ModuleSwap) -> dict[str, Any]:
    """What was decided for a module, as plain values (checkpoints, collectives)."""
    return {
        "status": entry.status,
        "backend": entry.backend,
        "reason": entry.reason,
        "packed_backend": entry.packed_backend,
        "parity_error": entry.parity_error,
        "speedup": entry.speedup,
        "checked": entry.checked,
    }


def _differs(ours: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> bool:
    if ours is None or theirs is None:
        return ours is not theirs
    if ours["status"] != theirs["status"]:
        return True
    if ours.get("packed_backend") != theirs.get("packed_backend"):
        return True
    return bool(ours["status"] == "active" and ours["backend"] != theirs["backend"])


def _said(decided: Mapping[str, Any] | None) -> str:
    if decided is None:
        return "did not find it"
    if decided["status"] == "reverted":
        return f"reverted it ({decided['reason']})"
    if decided["status"] == "active":
        return f"picked {decided['backend']!r}"
    return "had not checked it yet"


def agree(report: SwapReport, *, rank: int, world_size: int, all_gather: AllGather) -> None:
    """Make this rank run rank 0's decisions; on rank 0, note what the others decided.

    A collective: every rank calls it once, at the same point. Modules not checked
    yet on rank 0 are left to each rank. On rank 0 each module's ``ranks`` column
    says what other ranks had decided, and one warning lists it.

    Args:
        report: this rank's report (its swaps adopt rank 0's decisions).
        rank: this process's rank; rank 0 decides.
        world_size: how many ranks call it.
        all_gather: fills a list of ``world_size`` with every rank's decisions.
    """
    mine = {entry.name: decision(entry) for entry in report.modules}
    everyone: list[Any] = [None] * world_size
    all_gather(everyone, mine)  # once per fit, not per step
    chosen: dict[str, dict[str, Any]] = everyone[0]
    if rank != 0:
        for name, decided in chosen.items():
            swap = report._swaps.get(name)
            if swap is not None and _differs(decided, mine.get(name)):
                swap.adopt(decided, "on rank 0", pin=True, trust=True)
        return
    notes = []
    entries = {entry.name: entry for entry in report.modules}
    for other, theirs in enumerate(everyone[1:], start=1):
        for name in sorted(set(chosen) | set(theirs)):
            if not _differs(chosen.get(name), theirs.get(name)):
                continue
            note = f"rank {other} {_said(theirs.get(name))}"
            entry = entries.get(name)
            if entry is not None:
                entry.ranks = "; ".join(filter(None, (entry.ranks, note)))
            notes.append(f"{name or '(root)'}: {note}")
    if notes:
        rank_zero_warn(
            "AttentionSwap: the ranks had decided differently; every rank now runs rank 0's "
            "decisions. " + "; ".join(notes) + "."
        )
