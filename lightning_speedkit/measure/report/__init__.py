"""From a profiler trace to a diagnosis: where a step's time goes, and the one-line fix.

``analyze_trace`` reads a chrome trace written by ``torch.profiler`` (ours from
:class:`~lightning_speedkit.ProfilerSchedule`, Lightning's ``PyTorchProfiler``, or a
plain ``torch.profiler.profile``; gzip or not) and returns a :class:`Report`:

- ``breakdown``: each step's wall time split into :data:`CATEGORIES` (fractions that
  add up to 1). On a CPU-only trace the main thread is the device: every instant of
  it goes to the innermost operator running then (its self time), to data loading
  inside the loader's regions, to communication when another thread is in a
  collective while the main thread is not computing, and to ``overhead`` (Python,
  framework, waiting) otherwise. With CUDA kernels in the trace the GPU is the
  device: busy time goes to the kernels' categories (compute wins where it overlaps
  communication, so only exposed communication counts); idle time to data when the
  host is fetching a batch, to ``host_sync`` when the host has just waited for the
  device, and to ``overhead`` (launch-bound host) otherwise.
- ``modules``: each top-level child module's share of forward time.
- ``findings``: the decision tree of ``docs/measure.md`` ("The bottleneck report"), each
  with its numbers (``evidence``) and the fix the kit offers (``fix``), most costly first.

Thresholds are module constants (``DATA_SHARE`` ...) and can be read in the report.

The package, one job per module:

- ``trace``: reading a trace, refusing one the analysis cannot read.
- ``timeline``: each step's binned timeline, operators' self times, module shares.
- ``kernels``: operator and kernel names grouped into categories; kernel names shortened.
- ``sources``: the Python line of each host-device sync (``.item()``...).
- ``rules``: the diagnosis, one rule per finding kind, run in the order of ``RULES``.
- ``output``: the :class:`Report`, as markdown, JSON and PNG.
- ``analyze``: ``analyze_trace``, which runs them in that order.
"""

from lightning_speedkit.measure.report.analyze import analyze_trace
from lightning_speedkit.measure.report.output import Report
from lightning_speedkit.measure.report.rules import Finding
from lightning_speedkit.measure.report.timeline import CATEGORIES
from lightning_speedkit.measure.report.trace import load_trace

__all__ = ["CATEGORIES", "Finding", "Report", "analyze_trace", "load_trace"]

# Beside __all__, what was importable here when the report was one module stays so
# (``name as name``: an explicit re-export): the thresholds, KINDS, BINS_PER_STEP,
# ProfilerSchedule's amend_for_callbacks, and two helpers the tests check directly.
from lightning_speedkit.measure.report.kernels import _short_kernel_name as _short_kernel_name
from lightning_speedkit.measure.report.rules import ATTENTION_SHARE as ATTENTION_SHARE
from lightning_speedkit.measure.report.rules import COMMUNICATION_SHARE as COMMUNICATION_SHARE
from lightning_speedkit.measure.report.rules import COPY_SHARE as COPY_SHARE
from lightning_speedkit.measure.report.rules import DATA_SHARE as DATA_SHARE
from lightning_speedkit.measure.report.rules import HOST_BOUND_SHARE as HOST_BOUND_SHARE
from lightning_speedkit.measure.report.rules import HOST_SYNC_SHARE as HOST_SYNC_SHARE
from lightning_speedkit.measure.report.rules import KINDS as KINDS
from lightning_speedkit.measure.report.rules import MEMORY_SHARE as MEMORY_SHARE
from lightning_speedkit.measure.report.rules import VISION_SHARE as VISION_SHARE
from lightning_speedkit.measure.report.rules import amend_for_callbacks as amend_for_callbacks
from lightning_speedkit.measure.report.timeline import BINS_PER_STEP as BINS_PER_STEP
from lightning_speedkit.measure.report.timeline import _top_level_names as _top_level_names
