"""ProfilerSchedule under faults that used to kill the process; one fault per case, in a row.

Usage: ``python profiler_faults.py OUT_JSON CASE:DIR [CASE:DIR ...]``. Each case trains a
small model for 10 steps with a ProfilerSchedule whose trace writes fail, or beside another
profiler, and records whether training finished, what was warned and what was left in
the directory. A regression is a segfault (exit 139), which is why this runs in its own
process: the test reads the JSON written after every case.

Cases: ``vanish-<shape>`` (the directory is removed after the first step),
``replace-<shape>`` (the directory is replaced by a file after the first step), ``full-<shape>``
(DIR is a tiny filesystem, already full enough that no trace fits), ``lightning`` (with
``Trainer(profiler="pytorch")``), ``outer`` (inside a ``torch.profiler.profile`` block).
A shape is ``<wait>w<repeat>r`` (e.g. ``0w0r``: a window right after the last, forever).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import ProfilerSchedule
from tests.helpers.models import MLP, loader

STEPS = 10


class _Vanish(L.Callback):
    def __init__(self, directory: Path, replace: bool = False) -> None:
        self.directory, self.replace = directory, replace

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            shutil.rmtree(self.directory, ignore_errors=True)
            if self.replace:  # a file takes the directory's name
                self.directory.write_text("")


def run(case: str, directory: Path) -> dict[str, Any]:
    kind, _, shape = case.partition("-")
    wait, repeat = (int(x) for x in shape.rstrip("r").split("w")) if shape else (1, 1)
    traces = directory / "traces" if kind in ("vanish", "replace") else directory
    callback = ProfilerSchedule(wait=wait, warmup=1, active=2, repeat=repeat, dirpath=traces)
    callbacks: list[L.Callback] = [callback]
    if kind in ("vanish", "replace"):
        callbacks.insert(0, _Vanish(directory / "traces", replace=kind == "replace"))
    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks,
                        profiler="pytorch" if kind == "lightning" else None,
                        default_root_dir=directory / "root")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "outer":
            with torch.profiler.profile():
                trainer.fit(MLP(), loader(n=256))
        else:
            trainer.fit(MLP(), loader(n=256))
    ours = [str(w.message) for w in caught if "ProfilerSchedule" in str(w.message)]
    left = sorted(p.name for p in directory.glob("*")) if directory.is_dir() else []
    return {"steps": trainer.global_step, "warnings": ours, "left": left,
            "traces": [p.name for p in callback.traces]}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    for spec in sys.argv[2:]:
        case, _, directory = spec.partition(":")
        results[case] = run(case, Path(directory))
        out.write_text(json.dumps(results))  # after every case: a crash keeps the others


if __name__ == "__main__":
    main()
