"""RegionalCompile: ``torch.compile`` of the model's repeated blocks, in place.

Compiling a whole model traces every layer of it; compiling its repeated blocks
(transformer layers, ViT blocks) traces one block per block class, and every other
instance of that class reuses the compiled code: compile time is about one block's,
whatever the depth. Each block is compiled with ``nn.Module.compile()``, which
compiles the module's call in place rather than wrapping it, so parameter names,
``state_dict`` keys, the optimizer's parameters and checkpoints are exactly those of
the uncompiled model (no ``_orig_mod.`` prefix), and a checkpoint loads into a model
that was never compiled. torch's own layers (``nn.TransformerEncoderLayer``), whose
frames dynamo never compiles, are called from a frame of the kit's so that they compile
too (see :func:`compile_blocks`).

Compilation happens lazily, at a block's first call. :class:`CompileWatch` counts
what dynamo compiles (graphs, recompilations, seconds) from torch's compile
callbacks: plain Python counters, read by the callback at log time, no device sync.

A KV cache defeats the sharing: Hugging Face decoders (GPT-2, Llama, T5) build one by
default (``config.use_cache=True``), in training too, and each layer reads its own slot
of it, on which dynamo guards, so every layer compiles a graph of its own and past
dynamo's recompile limit (8) the rest run eagerly. Training needs no cache:
:class:`RegionalCompile` turns ``use_cache`` off for the fit (restored at its end), and
a compiled block's first call with a cache warns.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_speedkit import _compat, _validation
from lightning_speedkit._blocks import CacheOff
from lightning_speedkit._loggers import log_metrics
from lightning_speedkit._model_ready import forget_pending, when_model_ready
from lightning_speedkit.compute._block_compile import (
    CACHE_CALLED,
    BlockChoice,
    CompileMode,
    check_backend_name,
    check_options,
    compile_blocks,
    compiled_blocks,
    cpu_compiler_missing,
)
from lightning_speedkit.compute._compile_report import first_step_report, no_blocks_message
from lightning_speedkit.compute._recompile_advice import recompile_warning, warn_at

# CompileWatch is a measurement and lives in measure/; importable from here as it always was.
from lightning_speedkit.measure._compile_watch import CompileWatch

__all__ = ["CompileWatch", "RegionalCompile", "compile_blocks", "compiled_blocks"]

# --- the callback -------------------------------------------------------------------------------


class RegionalCompile(L.Callback):
    """Runs :func:`compile_blocks` on the LightningModule in ``setup``; counts the cost.

    A LightningModule that builds its layers in ``configure_model`` has its blocks
    compiled right after that hook (Lightning calls it after ``setup``). Either way
    before the strategy wraps the model, so DDP, the ZeRO-2 presets and DeepSpeed
    all run compiled blocks, and together with ``AttentionSwap`` and
    ``ActivationCheckpointing`` in any order (the compiled call traces the forward
    the block has at its first call). Checkpoints keep the uncompiled names.

    A Hugging Face model whose ``config.use_cache`` is True (GPT-2, Llama, T5 by
    default) builds a KV cache at every call, training included, and each layer reads
    its own slot of it: every layer would compile a graph of its own. The callback sets
    ``use_cache`` to False on the configs of the modules around the compiled blocks for
    the fit, and for a later validate, test or predict of the compiled model (one info
    line says so), and restores it when that ends: a loss uses no cache, and
    ``generate`` takes its own setting from the generation config.

    When nothing is compiled it warns: ``"auto"`` found no repeated block (a layer held
    once and called in a loop, as ALBERT's, or one layer listed ``n`` times, is one
    instance: the warning names the classes to pass as ``blocks=[...]``, the likeliest
    first), or the first training step compiled no graph for block classes no earlier
    first step compiled since dynamo was last reset (the warning names them and how to
    find why).

    What compilation cost is logged every ``log_every_n_steps`` while it changes:
    ``compile/seconds``, ``compile/graphs`` and ``compile/recompiles`` (everything
    dynamo compiled in the process during the fit). When one compiled frame keeps
    recompiling (``recompile_warning`` times beyond one compilation per block class, and
    at the latest when it holds as many graphs as dynamo keeps of one function,
    ``torch._dynamo.config.recompile_limit``, 8 by default, past which its calls run
    uncompiled), one warning names the block class and the likely cause with the fix: a
    KV cache passed to the blocks (``use_cache=False``); instances with different
    parameter shapes, a UNet's channel counts (a higher ``recompile_limit``, or fewer
    block classes named); inputs whose shape depends on the place in the network, seen
    within the first step (``dynamic=True``); new batch shapes (``dynamic=True``, or fewer
    distinct shapes by length bucketing or sequence packing,
    :class:`~lightning_speedkit.SpeedDataModuleMixin`); with ``dynamic=True`` already
    set, a guard that ``TORCH_LOGS=recompiles`` shows.

    Args:
        blocks: ``"auto"`` (the model's repeated blocks) or module classes or names.
        mode: ``torch.compile`` mode; None (default) to start with.
        dynamic: None (default: symbolic after the first shape change), True or False.
        fullgraph: require each block to compile into one graph.
        backend: ``"inductor"`` (default) or any ``torch.compile`` backend. On CPU
            inductor needs a C++ compiler: without one the blocks are left uncompiled,
            with a warning. A name torch does not register is refused here.
        recompile_warning: recompilations of one frame that trigger the warning (capped
            at dynamo's ``recompile_limit`` less one, read when it is checked).
        verbose: print what was compiled, and the compile time after the first step.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[RegionalCompile()], logger=False)
    """

    def __init__(
        self,
        blocks: BlockChoice = "auto",
        mode: CompileMode | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
        backend: str | Callable[..., Any] = "inductor",
        *,
        recompile_warning: int = 4,
        verbose: bool = True,
    ) -> None:
        check_options(mode, dynamic, fullgraph, backend, blocks)
        check_backend_name(backend)  # a typo fails here, not when the fit starts
        _validation.positive_int("recompile_warning", recompile_warning,
                                 hint="4 warns well before dynamo's limit of 8")  # fmt: skip
        _validation.boolean("verbose", verbose)
        self.blocks = blocks
        self.mode = mode
        self.dynamic = dynamic
        self.fullgraph = fullgraph
        self.backend = backend
        self.recompile_warning = recompile_warning
        self.verbose = verbose
        self.compiled: list[str] = []
        self.watch = CompileWatch()
        self._logged: tuple[int, int, float] = (0, 0, 0.0)
        self._reported = False
        self._warned = False
        self._classes = 1
        self._cache_off = CacheOff()
        self._kinds: list[type[nn.Module]] = []  # the compiled blocks' classes
        self._first_step: dict[str, int] = {}  # the watch's by_frame after the first step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":  # validate, test, predict: blocks a fit compiled stay compiled
            self._turn_cache_off(pl_module, compiled_blocks(pl_module), stage)
            return
        self._reported = False
        self.watch.remove()  # each fit counts its own compilations (a later fit reuses the
        self.watch, self._logged = CompileWatch(), (0, 0, 0.0)  # compiled blocks)
        on_cpu = trainer.strategy.root_device.type == "cpu"
        # A module that builds its blocks in configure_model: compiled right after it.
        when_model_ready(pl_module, partial(self._compile, pl_module, on_cpu))

    def _compile(self, pl_module: L.LightningModule, on_cpu: bool) -> None:
        missing = cpu_compiler_missing(self.backend) if on_cpu else None
        if missing is not None:
            rank_zero_warn(
                f"RegionalCompile: {missing}. The blocks stay uncompiled; install g++ or "
                f"clang++ (e.g. `apt install g++`) to compile them."
            )
            self.compiled = []
            return
        self.compiled = compile_blocks(
            pl_module, self.blocks, mode=self.mode, dynamic=self.dynamic,
            fullgraph=self.fullgraph, backend=self.backend,
        )  # fmt: skip
        self._turn_cache_off(pl_module, self.compiled, "fit")
        self.watch.install()
        found = {type(pl_module.get_submodule(name)) for name in self.compiled}
        self._kinds = sorted(found, key=lambda kind: kind.__name__)
        kinds = [kind.__name__ for kind in self._kinds]
        # Blocks whose forward the kit replaced (activation checkpointing) all run through
        # one function: dynamo compiles that frame once per block class, not a shape problem.
        self._classes = max(1, len(kinds))
        if not self.compiled:
            rank_zero_warn(no_blocks_message(pl_module, self.blocks))  # say what to name
        elif self.verbose:
            rank_zero_info(
                f"RegionalCompile: {len(self.compiled)} blocks ({', '.join(kinds)}) compile "
                f"in place at their first call (backend={self.backend!r})"
            )

    def _turn_cache_off(self, pl_module: L.LightningModule, names: list[str], stage: str) -> None:
        """``config.use_cache = False`` around the compiled blocks ``names`` for this stage
        (a KV cache makes each layer compile apart); restored by ``CacheOff.restore``."""
        holders = self._cache_off.turn_off(pl_module, names)
        if holders and self.verbose:
            stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn
            rank_zero_info(
                f"RegionalCompile: `config.use_cache` off for the {stage} on "
                f"{holders}, restored at its end: a KV cache, which "
                f"the loss does not use, makes each layer compile a graph of its own"
            )

    def _recompile_warning(self, pl_module: L.LightningModule, limit: int) -> str:
        blocks = [pl_module.get_submodule(name) for name in self.compiled]
        return recompile_warning(
            self.watch, blocks, cache_called=any(block in CACHE_CALLED for block in blocks),
            dynamic=self.dynamic, first_step=self._first_step, limit=limit,
        )  # fmt: skip

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.compiled:
            return
        watch = self.watch
        if not self._reported:
            self._reported, self._first_step = True, dict(watch.by_frame)
            warn, said = first_step_report(
                watch.graphs, watch.seconds, self._kinds, len(self.compiled)
            )
            if warn:  # compiled nothing, now or in an earlier fit: the blocks run eagerly
                rank_zero_warn(said)
            elif self.verbose:
                rank_zero_info(said)
        if not self._warned:
            limit = _compat.dynamo_recompile_limit()  # a frame holds at most `limit` graphs
            if watch.most_recompiled >= warn_at(self.recompile_warning, self._classes, limit):
                self._warned = True
                rank_zero_warn(self._recompile_warning(pl_module, limit))
        now = watch.snapshot()
        if now != self._logged and _compat.lightning_logs_now(trainer):
            self._log(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.compiled and self.watch.snapshot() != self._logged:
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        self._logged = self.watch.snapshot()
        graphs, recompiles, seconds = self._logged
        metrics = {"compile/seconds": seconds, "compile/graphs": float(graphs),
                   "compile/recompiles": float(recompiles)}  # fmt: skip
        log_metrics(trainer, metrics)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.watch.remove()
        forget_pending(pl_module)
        self._cache_off.restore()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        forget_pending(pl_module)  # a fit that failed before configure_model
        self.watch.remove()
        self._cache_off.restore()
