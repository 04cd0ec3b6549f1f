"""The demo's figures quoted in the README and the docs are the ones its results file holds.

`benchmarks/results/demo_cpu.json` keeps every published pair of `speedkit demo` runs;
the README and docs/getting-started.md show the first pair's table as the demo prints it,
and quote the speed-ups of the pairs. Each quote is checked against the file here, so a
re-measured demo cannot leave a stale figure behind (the figures are rendered by the
demo's own `comparison_table`, not copied by hand).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_speedkit._demo_results import DemoResult, comparison_table, time_per_sample

REPO = Path(__file__).resolve().parent.parent
RESULTS = json.loads((REPO / "benchmarks" / "results" / "demo_cpu.json").read_text())


def _pair(number: int) -> tuple[DemoResult, DemoResult]:
    (pair,) = [p for p in RESULTS["runs"] if p["pair"] == number]
    plain, kit = (DemoResult(**run) for run in pair["results"])
    assert (plain.run, kit.run) == ("plain", "kit")
    return plain, kit


def _speedups() -> list[float]:
    ratios = []
    for pair in RESULTS["runs"]:
        plain, kit = _pair(pair["pair"])
        assert plain.samples_per_sec
        assert kit.samples_per_sec
        ratios.append(kit.samples_per_sec / plain.samples_per_sec)
    return ratios


def _printed_table(page: Path) -> list[str]:
    """The demo's table as the page shows it: from the header row to the compute note."""
    lines = [line.strip() for line in page.read_text(encoding="utf-8").splitlines()]
    start = next(i for i, line in enumerate(lines) if line.split() == ["plain", "kit"])
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("(compute:"))
    return lines[start : end + 1]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_quoted_demo_table_is_the_first_pair_as_the_demo_prints_it(page: str) -> None:
    plain, kit = _pair(1)
    table = [line.strip() for line in comparison_table([plain, kit]).splitlines()]
    expected = table[: next(i for i, line in enumerate(table) if line.startswith("(compute:")) + 1]
    assert _printed_table(REPO / page) == expected


def test_the_readme_quotes_every_published_pair_and_no_other() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"three pairs, ([\d.]+)x, ([\d.]+)x and ([\d.]+)x", readme)
    assert quoted is not None, "the README names the three pairs' speed-ups"
    assert [float(x) for x in quoted.groups()] == [round(r, 2) for r in _speedups()]


def test_getting_started_splits_the_first_pair_as_its_table_does() -> None:
    plain, kit = _pair(1)
    plain_split, kit_split = time_per_sample(plain), time_per_sample(kit)
    assert plain_split is not None
    assert kit_split is not None
    text = " ".join((REPO / "docs" / "getting-started.md").read_text(encoding="utf-8").split())
    found = re.search(
        r"plain's ([\d,]+) µs could drop to its ([\d,]+) µs of compute, ([\d.]+)x at most\. "
        r"The kit's compute per sample is ([\d,]+) µs, ([\d.]+)x plain's",
        text,
    )
    assert found is not None
    total, compute, bound, kit_compute, ratio = found.groups()
    assert int(total.replace(",", "")) == round(plain_split[0])
    assert int(compute.replace(",", "")) == round(plain_split[2])
    assert float(bound) == round(plain_split[0] / plain_split[2], 2)
    assert int(kit_compute.replace(",", "")) == round(kit_split[2])
    assert float(ratio) == round(kit_split[2] / plain_split[2], 2)


def test_data_page_quotes_the_published_range() -> None:
    text = " ".join((REPO / "docs" / "data.md").read_text(encoding="utf-8").split())
    found = re.search(r"the kit run ([\d.]+)-([\d.]+)x the plain one", text)
    assert found is not None
    ratios = _speedups()
    assert (float(found[1]), float(found[2])) == (round(min(ratios), 2), round(max(ratios), 2))


H200 = REPO / "benchmarks" / "results" / "gpu_suite" / "2026-11-28_h200"


def _section(title: str) -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    start = text.index(f"## {title}")
    return text[start : text.index("\n## ", start + 1)]


def test_the_h200_hand_tuned_table_is_its_record() -> None:
    section = _section("The GPU check on an H200 (2026-11-28)")
    runs = json.loads((H200 / "quick_hand_tuned_cuda.json").read_text())["rounds"][0]
    speeds = [runs[name]["samples_per_sec"] for name in ("plain", "kit", "hand")]
    row = next(line for line in section.splitlines() if line.startswith("| samples/s |"))
    cells = [cell.split("(")[0].strip() for cell in row.split("|")[2:5]]
    assert cells == [f"{v:.1f}" for v in speeds]
    assert f"({speeds[1] / speeds[0]:.2f}x)" in row.replace("**", "")
    assert f"**{speeds[1] / speeds[2]:.2f}x**" in section
    mfu = next(line for line in section.splitlines() if line.startswith("| MFU |"))
    assert re.findall(r"\d+\.\d%", mfu) == [f"{100 * runs[n]['mfu']:.1f}%"
                                           for n in ("plain", "kit", "hand")]  # fmt: skip
    after = json.loads((H200 / "hand_tuned_cuda_plain_kit_after_fix.json").read_text())
    plain, kit = (after["rounds"][0][n]["samples_per_sec"] for n in ("plain", "kit"))
    assert f"plain {plain:.1f}, kit {kit:.1f} samples/s (**{kit / plain:.2f}x**)" in " ".join(
        section.split()
    )
