"""The records of ``bash benchmarks/gpu_suite.sh quick``: the device, the tests, the summary.

The quick stage runs each of its parts under ``timeout`` and calls this script after
each part (and after its tests), so that whatever a time limit cuts off, what had
finished is on disk as JSON:

    python benchmarks/quick_record.py device RESULTS  # quick_device.json: torch's view
    python benchmarks/quick_record.py tests RESULTS   # quick_tests.json, from pytest's JUnit
                                                      # XML, or its -v lines if cut off
    python benchmarks/quick_record.py summary RESULTS --setting STEPS=80 ...
                                                      # quick_summary.json, from quick_parts.tsv

The shell writes one tab-separated line per part (name, exit status, seconds, limit,
result files separated by commas; an empty exit status means it did not run, for want
of time) and one for the tests' pytest run when it ends (exit status, seconds). Only
``device`` imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
"""What a test file's record counts."""


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


def _junit_cases(path: Path) -> list[dict[str, str]] | None:
    """Each test case of a JUnit XML file; None if pytest wrote none (it was cut off)."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    cases = []
    for case in root.iter("testcase"):
        outcome = next((kind for tag, kind in _OUTCOMES if case.find(tag) is not None), "passed")
        detail = case.find({"failed": "failure", "errors": "error"}.get(outcome, "-"))
        message = (detail.get("message") or "") if detail is not None else ""
        cases.append({
            "module": _dotted(case.get("classname") or ""),
            "test": "::".join(n for n in (case.get("classname"), case.get("name")) if n),
            "outcome": outcome,
            "message": message.splitlines()[0][:300] if message else "",
        })  # fmt: skip
    return cases


def _dotted(path: str) -> str:
    """A test module's path as dots, ``..`` and ``.py`` left out: JUnit's classname form."""
    path = path[:-3] if path.endswith(".py") else path
    return ".".join(part for part in re.split(r"[/\\.]", path) if part)


def _same_module(a: str, b: str) -> bool:
    """One module named two ways (relative to another directory, or absolute)."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


_LOGGED = re.compile(r"^(\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_LOGGED_OUTCOME = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed",
                   "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "skipped"}  # fmt: skip


def _logged_cases(path: Path) -> list[dict[str, str]]:
    """Each test pytest -v reported as it ended (a run cut off before its JUnit XML)."""
    if not path.exists():
        return []
    cases = []
    for line in path.read_text(errors="replace").splitlines():
        found = _LOGGED.match(line)
        if found:
            file, name, word = found.groups()
            cases.append({"module": _dotted(file), "test": f"{file}::{name}",
                          "outcome": _LOGGED_OUTCOME[word], "message": ""})  # fmt: skip
    return cases


def pytest_record(results: Path) -> dict[str, Any]:
    """The tests part's one pytest run: each file's counts and failures, what was cut off.

    From the JUnit XML when pytest finished, else from its ``-v`` lines so far; the
    files it was given (``quick_tests_files.txt``) with no test reported are listed as
    not reached. ``quick_tests.tsv`` (exit status, seconds) exists once pytest ended.
    """
    cases = _junit_cases(results / "quick_tests.xml")
    complete = cases is not None
    if cases is None:
        cases = _logged_cases(results / "quick_tests_progress.log")
    listed = results / "quick_tests_files.txt"
    names = listed.read_text().split() if listed.exists() else []
    unlisted = {c["module"] for c in cases if not any(
        _same_module(c["module"], _dotted(n)) for n in names)}  # fmt: skip
    names += sorted(unlisted)  # a test pytest ran from elsewhere (a conftest's import)
    files = []
    for name in names:
        own = [c for c in cases if _same_module(c["module"], _dotted(name))]
        counts = dict.fromkeys(_COUNTS, 0)
        for case in own:
            counts["tests"] += 1
            counts[case["outcome"]] += 1
        problems = [{k: c[k] for k in ("test", "outcome", "message")}
                    for c in own if c["outcome"] in ("failed", "errors")]  # fmt: skip
        files.append({"file": name, "ran": bool(own), **counts, "problems": problems})
    (ended,) = _rows(results / "quick_tests.tsv") or [["", ""]]
    status = _status(ended[0])
    return {
        "date": _now(),
        "exit": status,
        "seconds": int(ended[1]) if ended[1] else None,
        "complete": complete,
        "files": files,
        "totals": {
            **{key: sum(f[key] for f in files) for key in _COUNTS},
            "files_not_reached": sum(not f["ran"] for f in files),
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
