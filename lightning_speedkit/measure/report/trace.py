"""Reading a trace: a chrome trace written by ``torch.profiler`` (a path to ``.json`` or
``.json.gz``, or the loaded dict), refused with the reason where the analysis could not
read it, and its complete events as :class:`_Event`; also the device memory figures a
trace carries (``deviceProperties``, ``[memory]`` events).

A trace is read as bytes and decoded leniently: torch's profiler with ``with_stack=True``
has been seen to write Python frame names that are not UTF-8, raw control characters
included (pytorch/pytorch issues 113564, 136040 and 130622; its own C++ export writes the
bytes as they are). One such name would otherwise cost the whole report: it is read with
U+FFFD in place of the bad bytes, and every other event as written.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from lightning_speedkit.errors import SpeedkitConfigError

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"


def load_trace(trace: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A chrome trace as a dict (a path to ``.json`` or ``.json.gz``, or the dict itself).

    Gzip is told by the file's first bytes, not its name: a compressed trace saved as
    ``.json`` is read too.
    """
    if isinstance(trace, Mapping):
        given = dict(trace)
        if isinstance(given.get("traceEvents"), list):
            _check_events(given, "The trace")
        return given
    path = Path(trace)
    if path.is_dir():
        raise SpeedkitConfigError(
            f"{path} is a directory, not a trace; give one of its .json or .json.gz traces."
        )
    if not path.is_file():
        raise SpeedkitConfigError(f"No trace at {path}.")
    try:
        raw = path.read_bytes()
        if raw[:2] == _GZIP_MAGIC:  # by content, not name: a gzip trace saved as .json
            raw = gzip.decompress(raw)
        data = json.loads(_decoded(raw, path), strict=False)
    except (OSError, ValueError, EOFError, zlib.error) as error:
        raise SpeedkitConfigError(
            f"{path} is not a chrome trace (JSON, optionally gzip): {error}"
        ) from error
    if isinstance(data, list):  # the bare-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise SpeedkitConfigError(f"{path} has no `traceEvents`: not a chrome trace.")
    _check_events(data, str(path))
    return data


def _decoded(raw: bytes, path: Path) -> str:
    """``raw`` as text, bytes that are not UTF-8 replaced (see the module's docstring)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        log.debug("%s: bytes that are not UTF-8 from offset %d on, replaced", path, error.start)
        return raw.decode("utf-8", errors="replace")


def _check_events(data: Mapping[str, Any], where: str) -> None:
    """Refuse a trace the analysis cannot read, naming the first bad event: events are
    JSON objects, a complete event's (``"ph": "X"``) times are finite microseconds, its
    ids are numbers or strings, and memory figures are numbers."""
    fix = "give a trace written by torch.profiler (ProfilerSchedule, Lightning's PyTorchProfiler)"

    def refuse(what: str, value: Any, why: str) -> NoReturn:
        raise SpeedkitConfigError(f"{where}: {what} is {_shown(value)}, {why}; {fix}.")

    for i, event in enumerate(data["traceEvents"]):
        if not isinstance(event, dict):
            refuse(f"event {i}", event, "not a JSON object")
        args = event.get("args", {})
        if not isinstance(args, dict) and (args is not None or event.get("name") == "[memory]"):
            refuse(f"event {i}'s `args`", args, "not a JSON object")
        args = args or {}
        if event.get("name") == "[memory]" and not _is_number(args.get("Total Reserved", 0)):
            refuse(f"event {i}'s `Total Reserved`", args["Total Reserved"], "not a number")
        if event.get("ph") != "X" or "ts" not in event:
            continue  # instants, counters and metadata: the analysis reads no more of them
        for key in ("ts", "dur"):
            if key in event and not _is_number(event[key]):
                refuse(f"event {i}'s `{key}`", event[key], "not a finite number of microseconds")
        for key, value in [("tid", event.get("tid"))] + [(k, args.get(k)) for k in _IDS]:
            if isinstance(value, (list, dict)):
                refuse(f"event {i}'s `{key}`", value, "not an id (a number or a string)")
    devices = data.get("deviceProperties") or []
    if not isinstance(devices, list):
        refuse("`deviceProperties`", devices, "not a JSON array")
    for device in devices:
        if isinstance(device, dict) and not _is_number(device.get("totalGlobalMem", 0)):
            refuse("`deviceProperties`' `totalGlobalMem`", device["totalGlobalMem"], "not a number")


_IDS = ("correlation", "External id", "Python id", "Python parent id")
"""The ``args`` that link events (kernel to launch, Python frame to caller): dict keys."""


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        return abs(float(value)) < float("inf")  # False for NaN too
    except ValueError:
        return False


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@dataclass
class _Event:
    name: str
    cat: str
    start: float
    end: float
    tid: Any
    args: dict[str, Any]

    @property
    def dur(self) -> float:
        return self.end - self.start


def _events(data: Mapping[str, Any]) -> list[_Event]:
    out = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        start = float(e["ts"])
        out.append(
            _Event(
                str(e.get("name", "")),
                str(e.get("cat", "")),
                start,
                start + float(e.get("dur", 0.0)),
                e.get("tid"),
                e.get("args") or {},
            )
        )
    return out


def _memory(
    data: Mapping[str, Any], events: list[_Event], given: tuple[float, float] | None
) -> dict[str, float] | None:
    if given is not None:
        peak, capacity = given
    else:
        props = data.get("deviceProperties") or []
        capacity = max(
            (float(p.get("totalGlobalMem", 0)) for p in props if isinstance(p, dict)), default=0.0
        )
        peaks = [
            float(e.get("args", {}).get("Total Reserved", 0))
            for e in data["traceEvents"]
            if e.get("name") == "[memory]"
        ]
        peak = max(peaks, default=0.0)
    if not capacity or not peak:
        return None
    return {"peak_bytes": peak, "device_bytes": capacity, "share": peak / capacity}
