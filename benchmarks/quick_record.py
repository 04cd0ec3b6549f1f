"""The records of ``bash benchmarks/gpu_suite.sh quick``: the device, the tests, the summary.

The quick stage runs each of its parts under ``timeout`` and calls this script after
each part (and after each test file), so that whatever a time limit cuts off, what had
finished is on disk as JSON:

    python benchmarks/quick_record.py device RESULTS  # quick_device.json: torch's view
    python benchmarks/quick_record.py tests RESULTS   # quick_tests.json, from quick_tests.tsv
    python benchmarks/quick_record.py summary RESULTS --setting STEPS=80 ...
                                                      # quick_summary.json, from quick_parts.tsv

The shell writes one tab-separated line per test file (file, exit status, seconds,
limit, JUnit XML path relative to RESULTS) and per part (name, exit status, seconds,
limit, result files separated by commas); an empty exit status means it did not run,
for want of time. Only ``device`` imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

TIMED_OUT = (124, 137)
"""``timeout``'s exit statuses: the command outlived its limit (137: it was killed)."""

PACKAGES = ("lightning", "torchmetrics", "transformers", "timm", "triton", "flash-attn",
            "xformers", "deepspeed", "pytest", "matplotlib")  # fmt: skip


_COUNTS = ("tests", "passed", "failed", "errors", "skipped")
"""What a test file's record counts, from its JUnit XML (None where pytest wrote none)."""


_OUTCOMES = (("failure", "failed"), ("error", "errors"), ("skipped", "skipped"))
"""A JUnit test case's child element, and the count it adds to (none: passed)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _rows(table: Path) -> list[list[str]]:
    """The tab-separated lines of ``table`` (none if it does not exist yet)."""
    if not table.exists():
        return []
    return [line.split("\t") for line in table.read_text().splitlines() if line.strip()]


def _status(exit_text: str) -> int | None:
    return int(exit_text) if exit_text else None


def _write(out: Path, record: dict[str, Any]) -> None:
    """``record`` as JSON at ``out``, replaced whole: a reader never sees half a file."""
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(out)


def device_record() -> dict[str, Any]:
    """The interpreter, torch, each CUDA device and the versions of the packages used."""
    import torch

    from lightning_speedkit.measure.peak import peak_flops, resolve_device_name

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "peak_table_row": resolve_device_name(props.name),
            "peak_bf16_flops": peak_flops(props.name, torch.bfloat16),
        })  # fmt: skip
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    return {
        "date": _now(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cuda_available": cuda,
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
        "devices": devices,
        "packages": versions,
    }


def _junit(path: Path) -> dict[str, Any] | None:
    """Counts and the failing tests of one JUnit XML file; None if pytest wrote none."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    counts = dict.fromkeys(_COUNTS, 0)
    problems = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        outcome = next((kind for tag, kind in _OUTCOMES if case.find(tag) is not None), "passed")
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            detail = case.find("failure" if outcome == "failed" else "error")
            message = (detail.get("message") or "") if detail is not None else ""
            problems.append({
                "test": "::".join(n for n in (case.get("classname"), case.get("name")) if n),
                "outcome": outcome,
                "message": message.splitlines()[0][:300] if message else "",
            })  # fmt: skip
    return {**counts, "problems": problems}


def pytest_record(results: Path) -> dict[str, Any]:
    """Each test file run so far (``quick_tests.tsv``), with its JUnit counts."""
    files = []
    for file, exit_text, seconds, limit, junit in _rows(results / "quick_tests.tsv"):
        status = _status(exit_text)
        counts = _junit(results / junit) if junit else None
        files.append({
            "file": file,
            "exit": status,
            "seconds": int(seconds) if seconds else None,
            "limit_s": int(limit) if limit else None,
            "timed_out": status in TIMED_OUT,
            "ran": status is not None,
            **(counts or {**dict.fromkeys(_COUNTS), "problems": []}),
        })  # fmt: skip
    totals = {key: sum(f[key] or 0 for f in files) for key in _COUNTS}
    return {
        "date": _now(),
        "files": files,
        "totals": {
            **totals,
            "files_timed_out": sum(f["timed_out"] for f in files),
            "files_not_run": sum(not f["ran"] for f in files),
        },
    }


def summary_record(results: Path, settings: dict[str, str]) -> dict[str, Any]:
    """Each part run so far (``quick_parts.tsv``): exit status, seconds, its result files."""
    parts = []
    for name, exit_text, seconds, limit, names in _rows(results / "quick_parts.tsv"):
        status = _status(exit_text)
        declared = [n for n in names.split(",") if n]
        parts.append({
            "name": name,
            "exit": status,
            "seconds": int(seconds) if seconds else None,
            "limit_s": int(limit) if limit else None,
            "timed_out": status in TIMED_OUT,
            "ran": status is not None,
            "results": declared,
            "missing": [n for n in declared if not (results / n).exists()],
        })  # fmt: skip
    return {
        "stage": "quick",
        "date": _now(),
        "settings": settings,
        "parts": parts,
        "passed": [p["name"] for p in parts if p["exit"] == 0],
        "failed": [p["name"] for p in parts if p["ran"] and p["exit"] != 0],
        "not_run": [p["name"] for p in parts if not p["ran"]],
    }


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("record", choices=("device", "tests", "summary"))
    parser.add_argument("results", type=Path, help="the quick stage's RESULTS directory")
    parser.add_argument("--setting", type=_setting, action="append", default=[],
                        help="NAME=VALUE kept in the summary (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.record == "device":
        record = device_record()
        out = args.results / "quick_device.json"
        shown = record["devices"] or [{"name": "no CUDA device"}]
        print(f"torch {record['torch']} (CUDA {record['torch_cuda']}), python {record['python']}: "
              + "; ".join(d["name"] for d in shown))  # fmt: skip
    elif args.record == "tests":
        record = pytest_record(args.results)
        out = args.results / "quick_tests.json"
    else:
        record = summary_record(args.results, dict(args.setting))
        out = args.results / "quick_summary.json"
    _write(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
