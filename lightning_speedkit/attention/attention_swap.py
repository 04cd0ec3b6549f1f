"""AttentionSwap: swap the model's attention to a fused backend as fit starts."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit import _validation
from lightning_speedkit._model_ready import forget_pending, when_model_ready
from lightning_speedkit.attention._documents import StepDocuments
from lightning_speedkit.attention._own_calls import remove_model_hooks
from lightning_speedkit.attention.backends import BackendChoice, check_backend
from lightning_speedkit.attention.swap import (
    SwapReport,
    agree_across_ranks,
    swap_attention,
    swapped_modules,
)

__all__ = ["AttentionSwap"]


class AttentionSwap(L.Callback):
    """Runs :func:`~lightning_speedkit.swap_attention` on the LightningModule in ``setup``.

    The swap happens before the strategy wraps the model (DDP, FSDP, DeepSpeed
    see the swapped modules; parameters are untouched); a LightningModule that builds
    its layers in ``configure_model`` is swapped right after that hook. Each swapped module is
    checked against its own forward on its first real inputs, forward and
    backward (forward only for one that holds FSDP2 units: a Hugging Face model
    under ``fsdp2_zero2``), inside the first training step (the step's numbers are the
    module's own); one that fails is reverted with a warning. After the first
    training batch every rank takes rank 0's decisions (each module's backend, or
    its revert; rank 0's report notes what other ranks had decided), the report
    is printed (rank 0) and ``attention/swapped`` and ``attention/reverted`` are
    logged.

    A packed training batch (``cu_seqlens``/``document_ids``, as
    :class:`~lightning_speedkit.data.PackingCollate` returns them) is handed to every
    swapped module for its step (:func:`~lightning_speedkit.attention.packed_documents`):
    their attention runs per document, and the first packed step warns once about
    attention that was not swapped (it attends across documents). Validation, test and
    predict batches (``trainer.validate``, ``trainer.test``, ``trainer.predict``) are
    handed over the same way.

    Args:
        backend: ``"auto"`` (default: time the candidates on the first real
            inputs and keep the fastest that passes, or the module's own forward where
            that was clearly faster), or one of ``"sdpa"``,
            ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"flex"``, ``"math"``.
            The default is ``"auto"`` where :func:`~lightning_speedkit.swap_attention`'s
            is ``"sdpa"``: timing can pick differently on each rank and in each run, and
            the callback is what settles that, every rank taking rank 0's picks after
            the first batch and a resumed run keeping the checkpoint's.
        tolerance: largest relative parity error that passes (default by
            dtype: 1e-4 fp32, 3e-2 bf16).
        measure: time own vs fused at the check for the report's speedups.
        verbose: print the report after the first training batch.

    Its state (each module's backend, or why it was reverted) is saved in
    checkpoints: a resumed run keeps ``auto``'s picks instead of timing again.
    ``report`` and that state describe the LightningModule alone: a deep copy of it
    (``WeightAveraging``'s average, an EMA teacher) finds, swaps and checks the
    modules it calls first in itself.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[AttentionSwap(backend="sdpa")], logger=False)
    """

    def __init__(
        self,
        backend: BackendChoice = "auto",
        *,
        tolerance: float | None = None,
        measure: bool = True,
        verbose: bool = True,
    ) -> None:
        check_backend(backend)
        _validation.optional(_validation.positive_number, "tolerance", tolerance, example=1e-3)
        _validation.boolean("measure", measure)
        _validation.boolean("verbose", verbose)
        self.backend = backend
        self.tolerance = tolerance
        self.measure = measure
        self.verbose = verbose
        self.report: SwapReport | None = None
        self._reported = False
        self._loaded: dict[str, Any] = {}
        self._documents = StepDocuments()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls configure_model after the callbacks' setup: its layers, after it
        when_model_ready(pl_module, partial(self._swap, pl_module))

    def _swap(self, pl_module: L.LightningModule) -> None:
        if self.report is not None and swapped_modules(pl_module):
            return  # a later fit() on the same module: already swapped
        self.report = swap_attention(
            pl_module, self.backend, tolerance=self.tolerance, measure=self.measure
        )
        self._reported = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._documents.enter(batch)  # a packed batch: its documents, for forward and backward

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._documents.enter(batch)  # packed evaluation batches: per document too

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._documents.exit(self.report, pl_module)

    # ``trainer.test`` and ``trainer.predict`` on packed batches: per document as validation.
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._documents.exit()
        forget_pending(pl_module)  # a fit that raised before configure_model

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._documents.exit(self.report, pl_module)
        if self._reported or self.report is None:
            return
        self._reported = True
        report = self.report
        # Every rank checked and timed on its own batch: all now run rank 0's decisions.
        agree_across_ranks(report)
        if self.verbose:
            rank_zero_info(f"AttentionSwap (backend={self.backend!r}):\n{report.to_markdown()}")
        pl_module.log("attention/swapped", float(len(report.swapped)), rank_zero_only=True)
        pl_module.log("attention/reverted", float(len(report.reverted)), rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:
        if self.report is None:
            return {}
        modules: dict[str, dict[str, Any]] = {}
        for m in self.report.modules:
            if m.status == "reverted":
                modules[m.name] = {
                    "status": "reverted",
                    "reason": m.reason,
                    "packed_backend": m.packed_backend,
                }
            elif m.status == "active":
                modules[m.name] = {"status": "active", "backend": m.backend}
        return {"backend": self.backend, "modules": modules}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback state after ``setup`` (the swaps exist) and
        # before ``on_fit_start``, where the saved decisions are applied.
        self._loaded = state_dict

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        remove_model_hooks()  # packed batches' global hooks: this run's only

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._documents = StepDocuments()  # its warning: once per fit
        state, self._loaded = self._loaded, {}
        if self.report is None:
            return
        for name, saved in state.get("modules", {}).items():
            swap = self.report._swaps.get(name)
            if swap is None:  # a traced module, found at its first call: decided then
                self.report._decided[name] = saved
                continue
            swap.adopt(
                saved, "in the run this one resumes", pin=self.backend == "auto", trust=False
            )
