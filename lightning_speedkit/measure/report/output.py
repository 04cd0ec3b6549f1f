"""A :class:`Report`, and its forms: markdown, JSON and a PNG of the breakdown."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_speedkit.measure.report.rules import Finding
from lightning_speedkit.measure.report.timeline import CATEGORIES


@dataclass
class Report:
    """A window's diagnosis; how each figure is made is in the package docstring
    (:mod:`lightning_speedkit.measure.report`)."""

    source: str
    device: str
    steps: int
    step_ms: float
    breakdown: dict[str, float]
    modules: dict[str, float]
    top_ops: list[dict[str, Any]]
    sync_sites: list[dict[str, Any]]
    findings: list[Finding]
    memory: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        """The findings' kinds, most costly first."""
        return [f.kind for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        lines = [
            "# speedkit report",
            "",
            f"{self.source}: {self.steps} step(s) on {self.device}, "
            f"{self.step_ms:.1f} ms per step.",
            "",
            "## Findings",
            "",
        ]
        for i, finding in enumerate(self.findings, 1):
            lines.append(
                f"{i}. **{finding.kind}** ({finding.share:.0%} of the step): {finding.evidence}  "
            )
            lines.append(f"   Fix: {finding.fix}")
        if not self.findings:
            lines.append("Nothing stands out.")
        lines += [f"\nNote: {note}." for note in self.notes]
        lines += [
            "",
            "## Where the step goes",
            "",
            "| category | share | ms per step |",
            "|---|---:|---:|",
        ]
        for name in CATEGORIES:
            share = self.breakdown.get(name, 0.0)
            lines.append(f"| {name} | {share:.1%} | {share * self.step_ms:.2f} |")
        if self.modules:
            lines += [
                "",
                "## Top-level modules (share of forward time)",
                "",
                "| module | share |",
                "|---|---:|",
            ]
            lines += [f"| {name} | {share:.1%} |" for name, share in self.modules.items()]
        if self.sync_sites:
            lines += [
                "",
                "## Host-device syncs in the step",
                "",
                "| call site | calls per step | ms per step |",
                "|---|---:|---:|",
            ]
            lines += [
                f"| `{s['site']}` | {s['per_step']:.1f} | {s['ms_per_step']:.3f} |"
                for s in self.sync_sites
            ]
        if self.top_ops:
            lines += [
                "",
                "## Top operators by self time",
                "",
                "| operator | category | ms per step | share |",
                "|---|---|---:|---:|",
            ]
            lines += [
                f"| `{op['name']}` | {op['category']} | {op['ms_per_step']:.2f} "
                f"| {op['share']:.1%} |"
                for op in self.top_ops
            ]
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path, stem: str = "speedkit_report") -> list[Path]:
        """Write ``<stem>.md``, ``<stem>.json`` and, with matplotlib, ``<stem>.png``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        md, js = directory / f"{stem}.md", directory / f"{stem}.json"
        md.write_text(self.to_markdown(), encoding="utf-8")
        js.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        written = [md, js]
        png = self.plot(directory / f"{stem}.png")
        if png is not None:
            written.append(png)
        return written

    def plot(self, path: str | Path) -> Path | None:
        """Step-time breakdown and module shares as one PNG (None without matplotlib)."""
        try:
            import matplotlib
        except ImportError:
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = 2 if self.modules else 1
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.6), squeeze=False)
        names = [c for c in CATEGORIES if self.breakdown.get(c, 0.0) > 0]
        shares = [100 * self.breakdown[c] for c in names]
        ax = axes[0][0]
        bars = ax.barh(names[::-1], shares[::-1], color="#4c72b0")
        ax.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
        ax.set_xlabel("% of step time")
        ax.set_title(f"step {self.step_ms:.1f} ms ({self.device})")
        ax.set_xlim(0, max(shares, default=1) * 1.25)
        if self.modules:
            ax = axes[0][1]
            labels = list(self.modules)
            values = [100 * v for v in self.modules.values()]
            bars = ax.barh(labels[::-1], values[::-1], color="#dd8452")
            ax.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
            ax.set_xlabel("% of forward time")
            ax.set_title("top-level modules")
            ax.set_xlim(0, max(values, default=1) * 1.25)
        kinds = ", ".join(self.kinds) or "nothing stands out"
        fig.suptitle(f"speedkit report: {kinds}", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
