"""The diagnosis's rules, one at a time, on hand-built evidence; and their registry.

Each rule gets the evidence just over (and just under) its threshold and must return
exactly the finding the report prints, or None.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

import lightning_speedkit
import lightning_speedkit.data
from lightning_speedkit.measure.report import CATEGORIES, KINDS, analyze_trace, rules
from lightning_speedkit.measure.report.rules import (
    RULES,
    Evidence,
    Finding,
    _diagnose,
    attention_rule,
    communication_rule,
    compute_rule,
    data_rule,
    host_sync_rule,
    memory_rule,
    vision_encoder_rule,
)
from tests.measure.test_report import synthetic_gpu_trace


def evidence(breakdown: dict[str, float] | None = None, **fields: Any) -> Evidence:
    """Evidence where nothing stands out but what the test sets (a 10 ms idle step)."""
    shares = dict.fromkeys(CATEGORIES, 0.0)
    shares.update(breakdown or {"overhead": 1.0})
    given: dict[str, Any] = {
        "breakdown": shares,
        "modules": {},
        "sync_sites": [],
        "memory": None,
        "unfused_attention": False,
        "step_ms": 10.0,
        "top_ops": [],
        "on_device": False,
    }
    given.update(fields)
    return Evidence(**given)


def site(name: str, user_code: bool, per_step: float = 1.0, share: float = 0.01) -> dict[str, Any]:
    return {"site": name, "user_code": user_code, "per_step": per_step,
            "ms_per_step": share * 10.0, "share": share}  # fmt: skip


def test_data_wait_from_the_threshold_up() -> None:
    finding = data_rule(evidence({"data": 0.25, "matmul": 0.75}, step_ms=40.0), ())
    assert finding is not None
    assert finding.kind == "data"
    assert finding.share == 0.25
    assert finding.evidence == (
        "data wait 25% of the step (10.0 of 40.0 ms): the model waits for the loader"
    )
    assert finding.fix.startswith("add NumWorkersTuner() to the callbacks")
    assert data_rule(evidence({"data": 0.10, "matmul": 0.90}), ()) is not None
    assert data_rule(evidence({"data": 0.09, "matmul": 0.91}), ()) is None


def test_host_sync_in_user_code_is_always_named() -> None:
    mine = site("train.py:12 in training_step: loss.item()", True, per_step=2.0, share=0.01)
    theirs = site("torch/optim/adam.py:90 in step", False, share=0.03)
    finding = host_sync_rule(evidence({"host_sync": 0.02, "overhead": 0.98},
                                      sync_sites=[mine, theirs]), ())  # fmt: skip
    assert finding is not None
    assert finding.kind == "host_sync"
    assert finding.share == pytest.approx(0.04)  # the sites' shares, above the breakdown's
    assert finding.evidence == (
        "host-device syncs in the step at train.py:12 in training_step: loss.item() "
        "(2x per step); 2% of the step here. On an accelerator each one blocks the host "
        "until all queued work is done, so the GPU idles while the next kernels are launched"
    )
    assert finding.details == {"sites": [mine]}  # only the user's is blamed


def test_host_sync_outside_user_code_only_when_it_costs() -> None:
    theirs = site("torch/optim/adam.py:90 in step", False, share=0.01)
    cheap = evidence({"host_sync": 0.04, "overhead": 0.96}, sync_sites=[theirs])
    assert host_sync_rule(cheap, ()) is None
    costly = evidence({"host_sync": 0.05, "overhead": 0.95}, sync_sites=[theirs])
    finding = host_sync_rule(costly, ())
    assert finding is not None
    assert finding.share == 0.05
    assert finding.details == {"sites": [theirs]}
    assert finding.evidence.startswith(
        "host-device syncs in the step at torch/optim/adam.py:90 in step (1x per step); 5% "
    )
    assert host_sync_rule(evidence(), ()) is None  # no syncs at all


def test_unfused_attention_only_when_unfused_and_over_the_threshold() -> None:
    shares = {"attention": 0.30, "matmul": 0.70}
    finding = attention_rule(evidence(shares, unfused_attention=True), ())
    assert finding is not None
    assert (finding.kind, finding.share) == ("attention", 0.30)
    assert finding.evidence == (
        "unfused attention (softmax and batched matmuls, no fused kernel) takes 30% of the step"
    )
    assert "AttentionSwap()" in finding.fix
    assert attention_rule(evidence(shares, unfused_attention=False), ()) is None  # fused
    below = evidence({"attention": 0.14, "matmul": 0.86}, unfused_attention=True)
    assert attention_rule(below, ()) is None


def test_exposed_communication_over_the_threshold() -> None:
    finding = communication_rule(evidence({"communication": 0.35, "matmul": 0.65}), ())
    assert finding is not None
    assert (finding.kind, finding.share) == ("communication", 0.35)
    assert finding.evidence == (
        "exposed gradient communication 35% of the step (not overlapped with compute)"
    )
    assert "strategy='ddp_powersgd'" in finding.fix
    assert communication_rule(evidence({"communication": 0.29, "matmul": 0.71}), ()) is None


def test_a_vision_tower_is_judged_by_its_share_of_the_step() -> None:
    shares = {"matmul": 0.9, "overhead": 0.1}  # compute: 90% of the step
    modules = {"language_model": 0.5, "vision": 0.5}
    finding = vision_encoder_rule(evidence(shares, modules=modules), ())
    assert finding is not None
    assert finding.kind == "vision_encoder"
    assert finding.share == pytest.approx(0.45)
    assert finding.evidence == (
        "the vision tower `vision` takes 50% of forward time, about 45% of the step"
    )
    # the same share under a name that is not a vision tower, or under 40% of the step
    assert vision_encoder_rule(evidence(shares, modules={"decoder": 0.5}), ()) is None
    low = evidence({"matmul": 0.7, "overhead": 0.3}, modules=modules)  # 35% of the step
    assert vision_encoder_rule(low, ()) is None


def test_memory_near_the_device_limit() -> None:
    memory = {"peak_bytes": 76 * 2**30, "device_bytes": 80 * 2**30, "share": 0.95}
    finding = memory_rule(evidence(memory=memory), ())
    assert finding is not None
    assert (finding.kind, finding.share) == ("memory", 0.95)
    assert finding.evidence == "peak memory 76.0 of 80.0 GiB (95%)"
    assert finding.fix.startswith("`speedkit plan --model MODULE:FACTORY")
    assert memory_rule(evidence(memory={**memory, "share": 0.89}), ()) is None
    assert memory_rule(evidence(memory=None), ()) is None


_TOP = [{"name": "k" * 70, "share": 0.4}, {"name": "add", "share": 0.3},
        {"name": "mm", "share": 0.2}, {"name": "never shown", "share": 0.1}]  # fmt: skip
_HEAVIEST = f"{'k' * 60} 40%, add 30%, mm 20%"


@pytest.mark.parametrize(
    ("shares", "on_device", "share", "text"),
    [
        pytest.param(
            {"matmul": 0.5, "elementwise": 0.1, "overhead": 0.4}, True, 1.0,
            "host-bound: the device idles 40% of the step with no data wait or sync to blame "
            "(kernels 60%, matmul 50%): the host does not launch work fast enough",
            id="host-bound",
        ),
        pytest.param(
            {"memory_copy": 0.4, "elementwise": 0.3, "matmul": 0.3}, False, 1.0,
            "compute-bound, and copies and dtype casts take 40% of the step (elementwise 30%, "
            f"matmul 30%); heaviest: {_HEAVIEST}",
            id="copies",
        ),
        pytest.param(
            {"elementwise": 0.6, "matmul": 0.3, "memory_copy": 0.1}, False, 1.0,
            "compute-bound, and elementwise kernels (60%: optimizer, casts, norms, activations) "
            f"outweigh the matmuls (30%); heaviest: {_HEAVIEST}",
            id="elementwise",
        ),
        pytest.param(
            {"matmul": 0.7, "elementwise": 0.2, "overhead": 0.1}, False, 0.9,
            f"compute-bound: operators 90% of the step (matmul 70%); heaviest: {_HEAVIEST}",
            id="matmul",
        ),
        pytest.param(  # idle on a CPU trace is not a host-bound device
            {"matmul": 0.5, "elementwise": 0.1, "overhead": 0.4}, False, 0.6,
            f"compute-bound: operators 60% of the step (matmul 50%); heaviest: {_HEAVIEST}",
            id="cpu-idle",
        ),
        pytest.param(  # a CPU step mostly outside any operator was called compute-bound
            {"matmul": 0.1, "elementwise": 0.08, "overhead": 0.82}, False, 1.0,
            "overhead-bound: 82% of the step is spent outside any operator (Python, the "
            "framework between operators) against 18% in operators (matmul 10%): the host's "
            "own work, not computation, sets the pace",
            id="cpu-overhead",
        ),
        pytest.param(  # overhead that does not outweigh the operators: compute-bound still
            {"matmul": 0.4, "elementwise": 0.1, "overhead": 0.5}, False, 0.5,
            f"compute-bound: operators 50% of the step (matmul 40%); heaviest: {_HEAVIEST}",
            id="cpu-overhead-even",
        ),
    ],
)  # fmt: skip
def test_compute_names_what_the_step_is_bound_by(
    shares: dict[str, float], on_device: bool, share: float, text: str
) -> None:
    finding = compute_rule(evidence(shares, top_ops=_TOP, on_device=on_device), ())
    assert finding is not None
    assert finding.kind == "compute"
    assert finding.share == pytest.approx(share)
    assert finding.evidence == text


_CPU_BF16 = (
    "bf16-mixed only on a CPU with native bf16 (AVX512_BF16 or AMX; elsewhere it is emulated "
    "and several times slower than float32: SpeedMonitor warns)"
)
_CPU_COMPILE = "measured against eager: on a CPU, compiled code of a small model can be slower"


@pytest.mark.parametrize(
    ("shares", "on_device", "fix"),
    [
        pytest.param(
            {"memory_copy": 0.4, "elementwise": 0.3, "matmul": 0.3}, True,
            "fewer copies: under autocast each fp32 result (norms, softmax, residual adds) is "
            "cast again before the next matmul, and .contiguous()/.reshape() copy transposed "
            "tensors; torch.compile fuses casts and copies into the kernels around them",
            id="copies-gpu",
        ),
        pytest.param(
            {"memory_copy": 0.4, "elementwise": 0.3, "matmul": 0.3}, False,
            "fewer copies: under autocast each fp32 result (norms, softmax, residual adds) is "
            "cast again before the next matmul (on a CPU without native bf16, "
            "precision='32-true' removes the casts and the emulation), and "
            ".contiguous()/.reshape() copy transposed tensors; torch.compile can fuse casts "
            f"and copies into the operators around them, {_CPU_COMPILE}",
            id="copies-cpu",
        ),
        pytest.param(
            {"elementwise": 0.6, "matmul": 0.3, "memory_copy": 0.1}, True,
            "a fused optimizer (torch.optim.AdamW(fused=True)), torch.compile to fuse the "
            "elementwise chains; bf16-mixed if not already",
            id="elementwise-gpu",
        ),
        pytest.param(
            {"elementwise": 0.6, "matmul": 0.3, "memory_copy": 0.1}, False,
            f"a fused optimizer (torch.optim.AdamW(fused=True)); {_CPU_BF16}; torch.compile "
            f"to fuse the elementwise chains, {_CPU_COMPILE}",
            id="elementwise-cpu",
        ),
        pytest.param(
            {"matmul": 0.7, "elementwise": 0.2, "overhead": 0.1}, True,
            "bf16-mixed precision if not already, a larger micro-batch, torch.compile; "
            "SpeedMonitor's MFU (`from lightning_speedkit import SpeedMonitor`) says how far "
            "from the hardware's peak",
            id="matmul-gpu",
        ),
        pytest.param(
            {"matmul": 0.7, "elementwise": 0.2, "overhead": 0.1}, False,
            f"a larger micro-batch; {_CPU_BF16}; torch.compile, {_CPU_COMPILE}; SpeedMonitor's "
            "MFU (`from lightning_speedkit import SpeedMonitor`) says how far from the "
            "hardware's peak",
            id="matmul-cpu",
        ),
    ],
)  # fmt: skip
def test_compute_fix_qualifies_bf16_and_compile_on_a_cpu(
    shares: dict[str, float], on_device: bool, fix: str
) -> None:
    """On a CPU trace bf16 helps only with native bf16 and torch.compile is to be measured
    (both measured slower on a CPU: benchmarks/cpu_step.py); a GPU trace keeps the plain advice."""
    finding = compute_rule(evidence(shares, top_ops=_TOP, on_device=on_device), ())
    assert finding is not None
    assert finding.fix == fix


@pytest.mark.parametrize(
    ("cuda_run", "fix"),
    [
        pytest.param(
            False,
            "fewer Python-side hooks and callbacks per step; a larger micro-batch (the same "
            f"calls, more work each); torch.compile, {_CPU_COMPILE}",
            id="cpu",
        ),
        pytest.param(
            True,
            "fewer Python-side hooks and callbacks per step; a larger micro-batch (the same "
            "calls, more work each); torch.compile (fewer, fused calls)",
            id="cuda-run-traced-without-kernels",
        ),
    ],
)  # fmt: skip
def test_an_overhead_bound_step_gets_the_hosts_fix_not_computes(cuda_run: bool, fix: str) -> None:
    shares = {"matmul": 0.1, "elementwise": 0.08, "overhead": 0.82}
    finding = compute_rule(evidence(shares, top_ops=_TOP, cuda_run=cuda_run), ())
    assert finding is not None
    assert finding.evidence.startswith("overhead-bound: 82% of the step")
    assert finding.fix == fix
    assert finding.details == {"bound": "overhead"}  # what keeps the fix the host's


def test_compute_only_when_nothing_before_it_explains_the_step() -> None:
    shares = {"matmul": 0.7, "overhead": 0.3}
    sync, memory, data = (Finding(kind, 0.1, "", "") for kind in ("host_sync", "memory", "data"))
    assert compute_rule(evidence(shares), (sync, memory)) is not None
    assert compute_rule(evidence(shares), (sync, data)) is None


# ------------------------------------------------------------------------- the registry


def firing(kind: str) -> Evidence:
    """Evidence on which the rule for ``kind`` returns a finding."""
    return {
        "data": evidence({"data": 0.5, "matmul": 0.5}),
        "host_sync": evidence(sync_sites=[site("train.py:3 in step", True)]),
        "attention": evidence({"attention": 0.5, "matmul": 0.5}, unfused_attention=True),
        "communication": evidence({"communication": 0.5, "matmul": 0.5}),
        "vision_encoder": evidence({"matmul": 1.0}, modules={"vision": 1.0}),
        "memory": evidence(memory={"peak_bytes": 95, "device_bytes": 100, "share": 0.95}),
        "compute": evidence({"matmul": 1.0}),
    }[kind]


def test_the_registry_has_one_rule_per_finding_kind_in_order() -> None:
    assert len(RULES) == len(KINDS)
    for rule, kind in zip(RULES, KINDS, strict=True):
        finding = rule(firing(kind), ())
        assert finding is not None, rule.__name__
        assert finding.kind == kind, rule.__name__
    assert set(rules._ALREADY_ON) <= set(KINDS)


def test_the_diagnosis_is_the_registry_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every finding a Report holds comes from a rule of RULES: with one stand-in rule,
    the report of a trace that has a data and a sync finding has only the stand-in's."""
    assert analyze_trace(synthetic_gpu_trace()).kinds == ["data", "host_sync"]
    seen: list[Evidence] = []

    def only(evidence: Evidence, found: Any) -> Finding:
        seen.append(evidence)
        return Finding("stand-in", 1.0, "", "")

    monkeypatch.setattr(rules, "RULES", (only,))
    report = analyze_trace(synthetic_gpu_trace())
    assert report.kinds == ["stand-in"]
    (given,) = seen
    assert given.breakdown == report.breakdown
    assert given.step_ms == report.step_ms
    assert given.on_device is True


def test_the_diagnosis_runs_the_rules_in_order_and_sorts_by_share() -> None:
    both = evidence({"data": 0.2, "communication": 0.5, "matmul": 0.3})
    assert [f.kind for f in _diagnose(both)] == ["communication", "data"]
    assert [f.kind for f in _diagnose(evidence({"matmul": 1.0}))] == ["compute"]


_IMPORT = re.compile(r"`from (lightning_speedkit[\w.]*) import ([\w, ]+)`")
_KIT_NAMES = set(lightning_speedkit.__all__) | set(lightning_speedkit.data.__all__)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fix_says_where_to_import_each_kit_name_it_names(kind: str) -> None:
    rule = RULES[KINDS.index(kind)]
    finding = rule(firing(kind), ())
    assert finding is not None
    # and where the callback is already on, the other names its fix then gives
    fixes = [(finding.fix, "")] + [
        (fix, on) for k, (on, fix) in rules._ALREADY_ON.items() if k == kind
    ]
    for fix, already_on in fixes:
        imported = set()
        for module, names in _IMPORT.findall(fix):
            for name in (n.strip() for n in names.split(",")):
                namespace: dict[str, Any] = {}
                exec(f"from {module} import {name}", namespace)  # the import works
                imported.add(name)
        named = {word for word in re.findall(r"\w+", fix) if word in _KIT_NAMES} - {already_on}
        assert named <= imported, (kind, named - imported)


def _compute_report(device: str) -> Any:
    from lightning_speedkit.measure.report import Report

    finding = Finding("compute", 0.9, "compute-bound", "torch.compile, a fused optimizer")
    return Report(source="t", device=device, steps=3, step_ms=10.0, breakdown={}, modules={},
                  top_ops=[], sync_sites=[], findings=[finding])  # fmt: skip


_MICRO_BATCH = "a larger micro-batch (`from lightning_speedkit import MicroBatchTuner`)"
_PER_BLOCK = "torch.compile per block (`from lightning_speedkit import RegionalCompile`)"


@pytest.mark.parametrize(
    ("device", "callbacks", "fix"),
    [
        pytest.param(
            "cuda", ["FusedOptimizer", "RegionalCompile", "SpeedMonitor"],
            "FusedOptimizer and RegionalCompile are already on; left: bf16-mixed precision if "
            f"not already, {_MICRO_BATCH}",
            id="cuda-both",
        ),
        pytest.param(
            "cuda", ["FusedOptimizer"],
            f"FusedOptimizer is already on; left: {_PER_BLOCK}, bf16-mixed precision if not "
            f"already, {_MICRO_BATCH}",
            id="cuda-fused",
        ),
        pytest.param(  # the demo's CPU run: torch.compile last, to be measured
            "cpu", ["FusedOptimizer"],
            f"FusedOptimizer is already on; left: {_MICRO_BATCH}, {_CPU_BF16}, {_PER_BLOCK}, "
            f"{_CPU_COMPILE}",
            id="cpu-fused",
        ),
        pytest.param(
            "cpu", ["FusedOptimizer", "RegionalCompile", "SpeedMonitor"],
            f"FusedOptimizer and RegionalCompile are already on; left: {_MICRO_BATCH}, "
            f"{_CPU_BF16}; on a CPU, time a run without RegionalCompile too: compiled blocks "
            "of a small model can be slower than eager",
            id="cpu-both",
        ),
        pytest.param(
            "cpu", ["RegionalCompile"],
            "RegionalCompile is already on; left: a fused optimizer (`from lightning_speedkit "
            f"import FusedOptimizer`), {_MICRO_BATCH}, {_CPU_BF16}; on a CPU, time a run "
            "without RegionalCompile too: compiled blocks of a small model can be slower than "
            "eager",
            id="cpu-compiled",
        ),
    ],
)  # fmt: skip
def test_a_compute_fix_leaves_out_the_levers_already_on(
    device: str, callbacks: list[str], fix: str
) -> None:
    from lightning_speedkit.measure.report import amend_for_callbacks

    report = _compute_report(device)
    amend_for_callbacks(report, callbacks)
    assert report.findings[0].fix == fix


@pytest.mark.parametrize("bound", ["host", "overhead"])
def test_a_host_or_overhead_bound_fix_is_not_turned_into_compute_levers(bound: str) -> None:
    from lightning_speedkit.measure.report import amend_for_callbacks

    report = _compute_report("cpu")
    report.findings[0].details["bound"] = bound  # as compute_rule marks such a finding
    amend_for_callbacks(report, ["RegionalCompile", "FusedOptimizer"])
    assert report.findings[0].fix == "torch.compile, a fused optimizer"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_compute_fix_is_kept_when_no_lever_is_on(device: str) -> None:
    from lightning_speedkit.measure.report import amend_for_callbacks

    untouched = _compute_report(device)
    amend_for_callbacks(untouched, ["SpeedMonitor"])
    assert untouched.findings[0].fix == "torch.compile, a fused optimizer"
