"""What the kit's DDP strategies share: gradients that stay views into DDP's buckets.

:class:`_KitDDPStrategy` is the base of ``DDPPowerSGDStrategy`` and
``DDPHalfPrecisionStrategy``: it takes DDP's bucket settings as typed arguments, refuses
at construction a keyword neither Lightning nor torch takes (:func:`check_ddp_kwargs`),
and keeps gradients bucket views through DDP's bucket rebuild and through gradient
accumulation. :func:`_comm_hook` gives a hook function the annotations DDP checks, and
:func:`refuse_hook_kwargs` refuses a hook of the user's beside the strategy's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit import _compat, _validation
from lightning_speedkit.errors import SpeedkitConfigError

log = logging.getLogger(__name__)
GradBucket = Any  # torch.distributed.GradBucket, which torch's stubs do not export
_Hook = Callable[[Any, Any], "torch.futures.Future[Tensor]"]


def _comm_hook(fn: _Hook) -> _Hook:
    """Give a hook the real annotations DDP checks (``from __future__`` makes them strings)."""
    fn.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[Tensor]})  # type: ignore[attr-defined]
    return fn


def refuse_hook_kwargs(owner: str, ddp_kwargs: dict[str, Any]) -> None:
    """Refuse a communication hook of the user's: ``owner`` registers its own."""
    for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
        if ddp_kwargs.get(key) is not None:  # LightningCLI passes DDPStrategy's None
            raise SpeedkitConfigError(
                f"`{key}` cannot be combined with {owner}, which registers its own hook; "
                f"use `DDPStrategy({key}=...)` for a hook of your own."
            )


def check_ddp_kwargs(owner: str, ddp_kwargs: dict[str, Any]) -> None:
    """Refuse at construction a keyword that neither DDPStrategy nor torch's DDP takes.

    Lightning's ``DDPStrategy`` keeps unknown keywords for ``DistributedDataParallel``,
    which would refuse them only when ``fit`` wraps the model.
    """
    accepted = _validation.accepted_keywords(
        DDPStrategy.__init__,
        DistributedDataParallel.__init__,
        exclude=("module", "device_ids"),  # Lightning passes these itself
    )
    _validation.check_keywords(owner, ddp_kwargs, accepted)


def _has_rebuilt_buckets(model: DistributedDataParallel) -> bool:
    """Whether DDP has laid out its buckets again in gradient-ready order (torch's own flag).

    torch keeps this in a private attribute; if a release renames it, the answer is
    True, which only turns off the early release below.
    """
    return bool(getattr(model, "_has_rebuilt_buckets", True))


class _KitDDPStrategy(DDPStrategy):
    """What the kit's DDP strategies share: gradients that stay views into DDP's buckets.

    ``gradient_as_bucket_view=True`` makes every gradient a view into DDP's
    communication buckets instead of a second fp32 copy beside them: 4 bytes per
    parameter less. torch alone still makes the second copy at two moments, which this
    class removes:

    - DDP lays its buckets out again in the second iteration's forward (in the order
      gradients became ready) while the gradients, views of the first buckets, keep
      those alive: Lightning zeroes them only after ``training_step``. Before that
      forward each gradient becomes a one-element zero expanded to its shape: the
      first buckets are freed before the new ones are allocated, and DDP, which copies
      defined gradients into its new buckets, still makes each one a view of them.
    - With gradient accumulation Lightning sets the gradients to None when a window
      opens, and under ``no_sync`` DDP's hooks do not run: autograd would allocate new
      gradients until the synchronised micro-batch. The bucket views, taken after the
      forward, are put back zeroed before the first backward of the window, which
      gives the sums ``zero_grad(set_to_none=False)`` would (not with
      ``find_unused_parameters`` or ``static_graph``, where DDP may leave a parameter
      without a gradient, which None keeps out of the optimizer step).

    Both act only where Lightning sets the gradients to None right after the forward
    (automatic optimization, the LightningModule's own ``optimizer_zero_grad``, the
    first batch of an accumulation window).
    """

    def __init__(
        self,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        gradient_as_bucket_view = _validation.boolean(
            "gradient_as_bucket_view", gradient_as_bucket_view
        )
        static_graph = _validation.boolean("static_graph", static_graph)
        check_ddp_kwargs(type(self).__name__, ddp_kwargs)
        ddp_kwargs = {**ddp_kwargs, "gradient_as_bucket_view": gradient_as_bucket_view}
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = _validation.positive_number(
                "bucket_cap_mb", bucket_cap_mb, example=25, hint="megabytes per bucket"
            )
        if static_graph:
            ddp_kwargs["static_graph"] = True
        super().__init__(**ddp_kwargs)
        self._window_closed = False  # no backward yet: no gradients to release
        self._opens_window = False
        self._views: list[tuple[torch.nn.Parameter, Tensor | None]] = []
        self.released_before_rebuild = False
        """Whether the first buckets' gradients were freed before DDP's bucket rebuild."""
        self.kept_views_in_no_sync = False
        """Whether gradients stayed bucket views through an accumulation window."""

    def setup(self, trainer: L.Trainer) -> None:
        if _compat.ddp_kwargs(self).get("static_graph") and trainer.accumulate_grad_batches > 1:
            _validation.fail(
                "static_graph", True,
                f"cannot be combined with gradient accumulation (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): torch's DDP fails an internal assertion "
                f"in the first backward under no_sync with a static graph",
                "leave `static_graph` out, or accumulate with `accumulate_grad_batches=1`",
            )  # fmt: skip
        super().setup(trainer)

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        model = self.model
        if isinstance(model, DistributedDataParallel):
            # False inside no_sync: an accumulation window goes on; True: it closed.
            self._window_closed = bool(model.require_backward_grad_sync)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._opens_window = self._window_closed and self._zeroes_after_forward()
        self._window_closed = False  # until a synchronised backward closes this one
        self._views = []
        model = self.model
        if not self._opens_window or not isinstance(model, DistributedDataParallel):
            return
        if not _has_rebuilt_buckets(model) and self._rebuilds():
            # DDP may lay out new buckets in this forward and copy each gradient into
            # them. Gradients that are views of the old buckets would keep those alive
            # beside the new ones; a zero of one element, expanded, frees them first and
            # still makes DDP hand each parameter a view of its new bucket.
            module = self.lightning_module
            assert module is not None  # checked by _zeroes_after_forward
            for parameter in module.parameters():
                if parameter.grad is not None:
                    zero = torch.zeros((), dtype=parameter.dtype, device=parameter.device)
                    parameter.grad = zero.expand_as(parameter)
            self.released_before_rebuild = True
            log.debug("gradients released before DDP's bucket rebuild (batch %d)", batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        model, module = self.model, self.lightning_module
        if (
            self._opens_window
            and self._keeps_views()
            and isinstance(model, DistributedDataParallel)
            and _has_rebuilt_buckets(model)
            and module is not None
        ):  # the bucket views, before Lightning sets the gradients to None
            self._views = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        return output

    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        views, self._views = self._views, []  # no reference left: autograd adds in place
        model = self.model
        if not views or not isinstance(model, DistributedDataParallel):
            return
        if model.require_backward_grad_sync:
            return  # a synchronised backward makes the gradients bucket views itself
        # Inside no_sync DDP's hooks do not run, and autograd would allocate new gradients
        # beside the buckets. Zeroed bucket views in their place hold the same sums (what
        # zero_grad(set_to_none=False) would have left).
        for parameter, view in views:
            if parameter.grad is None and view is not None:
                parameter.grad = view.zero_()
        self.kept_views_in_no_sync = True

    def _zeroes_after_forward(self) -> bool:
        """The gradients are DDP bucket views, and Lightning sets them to None after the
        forward of a batch that opens an accumulation window.

        A synchronised backward closes a window (under Lightning's own rule and under
        AccumulationScheduler's), so the batch after it opens one: with automatic
        optimization Lightning zeroes the gradients after its ``training_step``, through
        the LightningModule's ``optimizer_zero_grad``.
        """
        module = self.lightning_module
        return (
            bool(_compat.ddp_kwargs(self).get("gradient_as_bucket_view"))
            and isinstance(self.model, DistributedDataParallel)
            and module is not None
            and module.automatic_optimization
            and not is_overridden("optimizer_zero_grad", module, L.LightningModule)
        )

    def _rebuilds(self) -> bool:
        """Whether DDP lays its buckets out again (not with unused parameters, unless the
        graph is static)."""
        kwargs = _compat.ddp_kwargs(self)
        return bool(kwargs.get("static_graph") or not kwargs.get("find_unused_parameters"))

    def _keeps_views(self) -> bool:
        """Zeroed views may stand for None: DDP gives every parameter a gradient.

        With ``find_unused_parameters`` or ``static_graph`` DDP may leave a parameter
        without one, which None keeps out of the optimizer step and a zero would not.
        """
        kwargs = _compat.ddp_kwargs(self)
        return not (kwargs.get("find_unused_parameters") or kwargs.get("static_graph"))
