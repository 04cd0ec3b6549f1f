"""What ``speedkit demo`` measures: its settings, one run's figures, the side-by-side table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoConfig:
    """What ``speedkit demo`` trains. Each field is a command-line flag of the same name
    (``--batch-size`` for ``batch_size``; ``--only`` picks one of ``runs``), except
    ``warmup_steps`` and ``log_every_n_steps``, which only callers of ``run_demo`` set."""

    steps: int = 1500
    """Optimizer steps of each run (plain, then kit)."""
    size: str = "tiny"
    accelerator: str = "auto"
    devices: int = 1
    precision: str = "32-true"
    batch_size: int = 32
    global_batch: int | None = None
    """Samples per optimizer step over all devices (None: one batch per step)."""
    num_workers: int = 0
    """DataLoader workers of the plain run (the kit run tunes its own)."""
    data_dir: str | None = None
    output_dir: str = "speedkit_runs/demo"
    seed: int = 0
    warmup_steps: int = 10
    """Steps left out of the speed figures (start-up, allocator warm-up)."""
    log_every_n_steps: int = 50
    runs: tuple[str, ...] = ("plain", "kit")
    """Which runs to do: the plain Lightning baseline and/or the kit."""
    freeze_vision: bool = False
    """Both runs train with the vision tower frozen; the kit caches its features."""


@dataclass
class DemoResult:
    """One training run's figures; the speed figures are SpeedMonitor's summary.

    A figure that could not be measured (MFU without a known peak, speeds of a run
    shorter than its warm-up) is None, and the table shows "n/a".
    """

    run: str
    notes: list[str]
    size: str
    params: int
    devices: int
    steps: int
    samples_per_sec: float | None
    mfu: float | None
    data_wait_frac: float | None
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_p99: float | None
    mem_peak_gib: float | None
    loss_start: float
    loss_end: float
    val_loss: float
    val_acc: float
    wall_sec: float

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("model", f"{self.size} ({self.params / 1e6:.2f} M parameters)"),
            ("devices", str(self.devices)),
            ("steps", str(self.steps)),
            ("samples/s", _fmt(self.samples_per_sec, ",.1f")),
            ("MFU", _fmt(self.mfu, ".1%")),
            ("data wait (share of step)", _fmt(self.data_wait_frac, ".1%")),
            ("step time p50 (ms)", _fmt(self.step_ms_p50, ".1f")),
            ("step time p90 (ms)", _fmt(self.step_ms_p90, ".1f")),
            ("step time p99 (ms)", _fmt(self.step_ms_p99, ".1f")),
            ("peak memory (GiB)", _fmt(self.mem_peak_gib, ".2f")),
            ("train loss, first steps", f"{self.loss_start:.3f}"),
            ("train loss, last steps", f"{self.loss_end:.3f}"),
            ("held-out loss", f"{self.val_loss:.3f}"),
            ("held-out token accuracy", f"{self.val_acc:.1%}"),
            ("wall time (s)", f"{self.wall_sec:.1f}"),
        ]


def comparison_table(results: list[DemoResult]) -> str:
    """The runs side by side, with the kit's speed-up when both ran."""
    names = [r.run for r in results]
    columns = [dict(r.rows()) for r in results]
    keys = [k for k, _ in results[0].rows()]
    width = max(len(k) for k in keys)
    col = max(12, *(len(v) for c in columns for v in c.values()))
    lines = [f"{'':<{width}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    lines += [f"{k:<{width}}  " + "  ".join(f"{c[k]:>{col}}" for c in columns) for k in keys]
    by_name = {r.run: r for r in results}
    plain, kit = by_name.get("plain"), by_name.get("kit")
    if plain and kit and plain.samples_per_sec and kit.samples_per_sec:
        lines.append(f"\nkit / plain samples/s: {kit.samples_per_sec / plain.samples_per_sec:.2f}x")
        lines.append(
            "(the runs follow each other; on a shared machine identical runs differ by up to 10%)"
        )
        splits = [(r.run, split) for r in results if (split := time_per_sample(r)) is not None]
        if len(splits) == len(results):
            lines.append("where a sample's time went (µs per sample = data wait + compute):")
            for run, (total, data, compute) in splits:
                lines.append(f"  {run:<6} {total:>7,.0f} = {data:>6,.0f} + {compute:>7,.0f}")
            lines.append(
                "(compute: forward, backward, optimizer step and the loop; a loader can "
                "only remove the data wait)"
            )
    for r in results:
        lines += r.notes
    return "\n".join(lines)


def time_per_sample(result: DemoResult) -> tuple[float, float, float] | None:
    """A run's time per sample in µs, split as (total, data wait, the rest).

    The rest is the model's compute (forward, backward, optimizer step) and the loop's
    own time: what no loader can take away. None when a figure is missing.
    """
    speed, wait = result.samples_per_sec, result.data_wait_frac
    if not speed or wait is None:
        return None
    total = 1e6 / speed
    return total, total * wait, total * (1 - wait)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
