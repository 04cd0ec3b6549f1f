"""The diagnosis: one small rule per finding kind, run in the order of :data:`RULES`.

A rule reads the :class:`Evidence` measured from a trace, and the findings of the rules
before it, and returns a :class:`Finding` (what, how much of the step, the numbers behind
it, the kit's fix and where to import it) or None. A new kind of finding is a new rule
function, appended to :data:`RULES` with its kind appended to :data:`KINDS`; no other rule
changes. The thresholds are the constants below (``DATA_SHARE`` ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_speedkit.measure.report.output import Report

__all__ = [
    "KINDS",
    "RULES",
    "Evidence",
    "Finding",
    "Rule",
    "amend_for_callbacks",
    "attention_rule",
    "communication_rule",
    "compute_rule",
    "data_rule",
    "host_sync_rule",
    "memory_rule",
    "vision_encoder_rule",
]

#: Finding kinds, in the order the decision tree asks.
KINDS = ("data", "host_sync", "attention", "communication", "vision_encoder", "memory", "compute")

DATA_SHARE = 0.10  #: data wait above this share of the step is a finding
HOST_SYNC_SHARE = 0.05  #: syncs outside the user's code above this share are a finding
HOST_BOUND_SHARE = 0.30  #: device idle (unexplained) above this share: a host-bound step
ATTENTION_SHARE = 0.15  #: unfused attention above this share is a finding
COMMUNICATION_SHARE = 0.30  #: exposed communication above this share is a finding
VISION_SHARE = 0.40  #: a vision tower above this share of step time is flagged
MEMORY_SHARE = 0.90  #: peak memory above this share of the device is a finding
COPY_SHARE = 0.15  #: copies and dtype casts above this share name the compute finding

#: On a CPU trace the compute fixes qualify two levers that were measured to slow a CPU
#: step (benchmarks/cpu_step.py): bf16 where the CPU has no bf16 instructions, and
#: torch.compile on a small model. A trace does not say which CPU ran it, so the advice
#: says when each helps instead of guessing.
_CPU_BF16 = (
    "bf16-mixed only on a CPU with native bf16 (AVX512_BF16 or AMX; elsewhere it is "
    "emulated and several times slower than float32: SpeedMonitor warns)"
)
_CPU_COMPILE = "measured against eager: on a CPU, compiled code of a small model can be slower"

#: A vision-named module: one of these words at the start of a name's word (after a
#: non-letter, or capitalised in camelCase), not inside another word ("dispatcher"'s
#: "patch", "activity"'s "vit").
_VISION = re.compile(
    r"(?<![a-z])(?i:vision|visual|image|img|vit|pixel|patch)"
    r"|Vision|Visual|Image|Img|ViT|Vit|Pixel|Patch"
)
_COMPUTE = ("attention", "matmul", "elementwise", "memory_copy")


@dataclass
class Finding:
    """One diagnosis: what (``kind``), how much (``share`` of step time), the numbers
    behind it (``evidence``) and the fix the kit offers (``fix``)."""

    kind: str
    share: float
    evidence: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind}: {self.evidence} -> {self.fix}"


@dataclass(frozen=True)
class Evidence:
    """What the rules read: the figures :func:`analyze_trace` measured on a trace."""

    breakdown: Mapping[str, float]
    """Each category's share of the step (``Report.breakdown``: they add up to 1)."""
    modules: Mapping[str, float]
    """Each top-level module's share of forward time (``Report.modules``)."""
    sync_sites: Sequence[Mapping[str, Any]]
    """Host-device sync call sites (``Report.sync_sites``): ``site``, ``user_code``,
    ``per_step``, ``ms_per_step`` and ``share`` of step time."""
    memory: Mapping[str, float] | None
    """``peak_bytes``, ``device_bytes`` and their ``share``, when known."""
    unfused_attention: bool
    """A softmax ran on the host and no fused attention operator or kernel did."""
    step_ms: float
    """Milliseconds per step."""
    top_ops: Sequence[Mapping[str, Any]]
    """The heaviest operators or kernels (``Report.top_ops``): ``name``, ``share``..."""
    on_device: bool
    """The trace has CUDA kernels (the GPU is the device), not a CPU-only trace."""
    cuda_run: bool = False
    """The run computed on a CUDA device (kernels or CUDA runtime calls in the trace),
    whether or not the trace recorded the device's activity: its fixes are a GPU's."""

    @property
    def compute(self) -> float:
        """The share of the step spent in operators or kernels (the compute categories)."""
        return sum(self.breakdown[c] for c in _COMPUTE)


#: A rule: the evidence, and the findings of the rules before it -> a finding or None.
Rule = Callable[[Evidence, Sequence[Finding]], Finding | None]


def data_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """The model waits for the loader over ``DATA_SHARE`` of the step."""
    data, step_ms = evidence.breakdown["data"], evidence.step_ms
    if data >= DATA_SHARE:
        return Finding(
            "data",
            data,
            f"data wait {data:.0%} of the step ({data * step_ms:.1f} of {step_ms:.1f} ms): "
            "the model waits for the loader",
            "add NumWorkersTuner() to the callbacks (or SpeedDataModuleMixin; "
            "`from lightning_speedkit import NumWorkersTuner, SpeedDataModuleMixin`); "
            "pin_memory=True on GPUs; LengthBucketBatchSampler for variable-length captions "
            "(`from lightning_speedkit.data import LengthBucketBatchSampler`)",
        )
    return None


def host_sync_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """Host-device syncs: any in the user's own code (free on a CPU, a stall on a GPU),
    the framework's or unnamed ones (no stacks) only above ``HOST_SYNC_SHARE``."""
    sites, host_sync = evidence.sync_sites, evidence.breakdown["host_sync"]
    blamed = [s for s in sites if s["user_code"]]
    if not blamed and host_sync >= HOST_SYNC_SHARE:
        blamed = list(sites)
    if not blamed:
        return None
    share = max(sum(s["share"] for s in sites), host_sync)
    where = "; ".join(f"{s['site']} ({s['per_step']:.0f}x per step)" for s in blamed[:3])
    return Finding(
        "host_sync",
        share,
        f"host-device syncs in the step at {where}; {host_sync:.0%} of the "
        "step here. On an accelerator each one blocks the host until all queued work is "
        "done, so the GPU idles while the next kernels are launched",
        "keep the value on the device: self.log(name, tensor) instead of .item(); move "
        ".cpu()/.tolist() out of training_step (to a callback every N steps)",
        {"sites": blamed},
    )


def attention_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """Unfused attention (softmax, batched matmuls) over ``ATTENTION_SHARE`` of the step."""
    attention = evidence.breakdown["attention"]
    if evidence.unfused_attention and attention >= ATTENTION_SHARE:
        return Finding(
            "attention",
            attention,
            f"unfused attention (softmax and batched matmuls, no fused kernel) takes "
            f"{attention:.0%} of the step",
            "add AttentionSwap() to the callbacks (or swap_attention(model, 'auto'); "
            "`from lightning_speedkit import AttentionSwap, swap_attention`): fused "
            "SDPA/flash kernels, parity-checked",
        )
    return None


def communication_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """Communication not overlapped with compute over ``COMMUNICATION_SHARE`` of the step."""
    comm = evidence.breakdown["communication"]
    if comm >= COMMUNICATION_SHARE:
        return Finding(
            "communication",
            comm,
            f"exposed gradient communication {comm:.0%} of the step (not overlapped with compute)",
            "strategy='ddp_powersgd' (or 'ddp_bf16_compress' on fast links; both names "
            "registered by `import lightning_speedkit`); AccumulationScheduler(adaptive=True) "
            "to sync less often (`from lightning_speedkit import AccumulationScheduler`)",
        )
    return None


def vision_encoder_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """The first vision-named module whose share of the step (its forward share of the
    compute time: its backward scales with its forward) is over ``VISION_SHARE``."""
    for name, forward_share in evidence.modules.items():
        share = forward_share * evidence.compute
        if _VISION.search(name) and share >= VISION_SHARE:
            return Finding(
                "vision_encoder",
                share,
                f"the vision tower `{name}` takes {forward_share:.0%} of forward time, "
                f"about {share:.0%} of the step",
                "freeze it and cache its features if it is not trained; lower the image "
                "resolution or token count; AttentionSwap() for its attention "
                "(`from lightning_speedkit import AttentionSwap`)",
            )
    return None


def memory_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """Peak memory over ``MEMORY_SHARE`` of the device's."""
    memory = evidence.memory
    if memory is not None and memory["share"] >= MEMORY_SHARE:
        return Finding(
            "memory",
            memory["share"],
            f"peak memory {memory['peak_bytes'] / 2**30:.1f} of "
            f"{memory['device_bytes'] / 2**30:.1f} GiB ({memory['share']:.0%})",
            "`speedkit plan --model MODULE:FACTORY --gpus N --gpu-mem GIB` for a preset that "
            "fits (strategy='fsdp_zero2' or 'deepspeed_zero2', registered by "
            "`import lightning_speedkit`); ActivationCheckpointing() "
            "(`from lightning_speedkit import ActivationCheckpointing`)",
        )
    return None


def compute_rule(evidence: Evidence, found: Sequence[Finding]) -> Finding | None:
    """When no finding before it explains the step (a sync or memory finding does not):
    host-bound on a device idling over ``HOST_BOUND_SHARE``; on a host-only trace (a CPU
    run, or a CUDA run traced without its kernels) overhead-bound where the time outside
    any operator (Python, the framework between operators) is over ``HOST_BOUND_SHARE``
    and outweighs the operators: such a step is not compute-bound, and compute fixes would
    not touch it. Otherwise compute-bound, and by what (copies over ``COPY_SHARE``,
    elementwise kernels, or the matmuls). On a CPU trace the fix says where bf16 and
    torch.compile help, and names them last."""
    if any(f.kind not in ("host_sync", "memory") for f in found):
        return None
    cpu = not (evidence.on_device or evidence.cuda_run)
    breakdown, compute = evidence.breakdown, evidence.compute
    heaviest = ", ".join(f"{op['name'][:60]} {op['share']:.0%}" for op in evidence.top_ops[:3])
    idle, copies = breakdown["overhead"], breakdown["memory_copy"]
    bound = _host_bound(evidence, cpu)
    details = {"bound": bound[0]} if bound is not None else {}  # what the host's fix is for
    if bound is not None:
        _, evidence_text, fix = bound
    elif copies >= COPY_SHARE and copies + breakdown["elementwise"] > breakdown["matmul"]:
        evidence_text = (
            f"compute-bound, and copies and dtype casts take {copies:.0%} of the step "
            f"(elementwise {breakdown['elementwise']:.0%}, matmul "
            f"{breakdown['matmul']:.0%}); heaviest: {heaviest}"
        )
        fix = (
            "fewer copies: under autocast each fp32 result (norms, softmax, residual "
            "adds) is cast again before the next matmul, and .contiguous()/.reshape() "
            "copy transposed tensors; torch.compile fuses casts and copies into the "
            "kernels around them"
        )
        if cpu:
            fix = (
                "fewer copies: under autocast each fp32 result (norms, softmax, residual "
                "adds) is cast again before the next matmul (on a CPU without native bf16, "
                "precision='32-true' removes the casts and the emulation), and "
                ".contiguous()/.reshape() copy transposed tensors; torch.compile can fuse "
                f"casts and copies into the operators around them, {_CPU_COMPILE}"
            )
    elif breakdown["elementwise"] > breakdown["matmul"]:
        evidence_text = (
            f"compute-bound, and elementwise kernels ({breakdown['elementwise']:.0%}: "
            f"optimizer, casts, norms, activations) outweigh the matmuls "
            f"({breakdown['matmul']:.0%}); heaviest: {heaviest}"
        )
        fix = (
            "a fused optimizer (torch.optim.AdamW(fused=True)), torch.compile to fuse "
            "the elementwise chains; bf16-mixed if not already"
        )
        if cpu:
            fix = (
                f"a fused optimizer (torch.optim.AdamW(fused=True)); {_CPU_BF16}; "
                f"torch.compile to fuse the elementwise chains, {_CPU_COMPILE}"
            )
    else:
        evidence_text = (
            f"compute-bound: operators {compute:.0%} of the step (matmul "
            f"{breakdown['matmul']:.0%}); heaviest: {heaviest}"
        )
        fix = (
            "bf16-mixed precision if not already, a larger micro-batch, torch.compile; "
            "SpeedMonitor's MFU (`from lightning_speedkit import SpeedMonitor`) says how far "
            "from the hardware's peak"
        )
        if cpu:
            fix = (
                f"a larger micro-batch; {_CPU_BF16}; torch.compile, {_CPU_COMPILE}; "
                "SpeedMonitor's MFU (`from lightning_speedkit import SpeedMonitor`) says how "
                "far from the hardware's peak"
            )
    share = compute + (idle if evidence.on_device or bound is not None else 0.0)
    return Finding("compute", share, evidence_text, fix, details)


def _host_bound(evidence: Evidence, cpu: bool) -> tuple[str, str, str] | None:
    """What bounds the step, and the compute finding's text and fix, when the host sets
    the pace, else None: on a device idling over ``HOST_BOUND_SHARE`` (``"host"``), or, on
    a host-only trace, where the time outside any operator is over it and outweighs the
    operators (``"overhead"``)."""
    breakdown, compute, idle = evidence.breakdown, evidence.compute, evidence.breakdown["overhead"]
    if evidence.on_device and idle >= HOST_BOUND_SHARE:
        return (
            "host",
            f"host-bound: the device idles {idle:.0%} of the step with no data wait or "
            f"sync to blame (kernels {compute:.0%}, matmul {breakdown['matmul']:.0%}): "
            "the host does not launch work fast enough",
            "torch.compile (fewer, fused kernels) or CUDA graphs; a larger micro-batch "
            "per launch; fewer Python-side hooks per step",
        )
    if evidence.on_device or idle < HOST_BOUND_SHARE or idle <= compute:
        return None
    compile_ = f"torch.compile, {_CPU_COMPILE}" if cpu else "torch.compile (fewer, fused calls)"
    return (
        "overhead",
        f"overhead-bound: {idle:.0%} of the step is spent outside any operator (Python, the "
        f"framework between operators) against {compute:.0%} in operators (matmul "
        f"{breakdown['matmul']:.0%}): the host's own work, not computation, sets the pace",
        "fewer Python-side hooks and callbacks per step; a larger micro-batch (the same "
        f"calls, more work each); {compile_}",
    )


#: The diagnosis, in the order it asks (each rule sees the findings before it).
RULES: tuple[Rule, ...] = (
    data_rule,
    host_sync_rule,
    attention_rule,
    communication_rule,
    vision_encoder_rule,
    memory_rule,
    compute_rule,
)


def _diagnose(evidence: Evidence) -> list[Finding]:
    """Every rule of :data:`RULES` in order; the findings, most costly first."""
    found: list[Finding] = []
    for rule in RULES:
        finding = rule(evidence, tuple(found))
        if finding is not None:
            found.append(finding)
    return sorted(found, key=lambda f: -f.share)


_ALREADY_ON = {
    "data": (
        "NumWorkersTuner",
        "NumWorkersTuner is already on and this is what it could do: the loader has no "
        "spare cores for more workers here. Make each sample cheaper: decode it once "
        "(SpeedDataModuleMixin's speed_dataloader(..., cache=True), for a dataset that "
        "fits in memory and augments after loading; "
        "`from lightning_speedkit import SpeedDataModuleMixin`), smaller images; or give "
        "the loader cores",
    ),
    "attention": (
        "AttentionSwap",
        "AttentionSwap is already on: the attention left unfused is in modules it "
        "reverted (parity) or did not recognise; its report says which",
    ),
}


#: The compute levers a compute-bound step's fix would name, by callback class.
_COMPUTE_LEVERS = {
    "FusedOptimizer": "a fused optimizer (`from lightning_speedkit import FusedOptimizer`)",
    "RegionalCompile": "torch.compile per block (`from lightning_speedkit import RegionalCompile`)",
}


_MICRO_BATCH = "a larger micro-batch (`from lightning_speedkit import MicroBatchTuner`)"


def amend_for_callbacks(report: Report, callbacks: Iterable[str]) -> None:
    """Say so where a finding's fix is a callback the run already has (by class name).

    A compute-bound finding's fix names the compute levers left; a host- or overhead-bound
    one keeps its own fix, which those levers do not touch.

    On a CPU report the compute levers left are ranked by how surely they help there:
    bf16 only with native bf16, torch.compile last and to be measured against eager.
    """
    present, cpu = set(callbacks), report.device == "cpu"
    for finding in report.findings:
        name, fix = _ALREADY_ON.get(finding.kind, ("", ""))
        if name in present:
            finding.fix = fix
        on = [lever for lever in _COMPUTE_LEVERS if lever in present]
        # A host- or overhead-bound step's fix is the host's, not these compute levers.
        if finding.kind == "compute" and on and "bound" not in finding.details:
            missing = [lever for lever in _COMPUTE_LEVERS if lever not in present]
            if cpu:  # torch.compile last, and to be measured
                left = [_COMPUTE_LEVERS[lever] for lever in missing if lever != "RegionalCompile"]
                left += [_MICRO_BATCH, _CPU_BF16]
                if "RegionalCompile" in missing:
                    left.append(f"{_COMPUTE_LEVERS['RegionalCompile']}, {_CPU_COMPILE}")
            else:
                left = [_COMPUTE_LEVERS[lever] for lever in missing]
                left.append(f"bf16-mixed precision if not already, {_MICRO_BATCH}")
            verb = "is" if len(on) == 1 else "are"
            finding.fix = f"{' and '.join(on)} {verb} already on; left: " + ", ".join(left)
            if cpu and "RegionalCompile" in on:
                finding.fix += (
                    "; on a CPU, time a run without RegionalCompile too: compiled blocks of a "
                    "small model can be slower than eager"
                )
