"""_compat: the one package that reads torch's and Lightning's private names.

Three guards: the package reads no private torch or Lightning name outside _compat/
(a scan of the source); every private name _compat reads resolves on the installed
versions (so an upgrade that removes one fails here, not in a user's run); and a name
that is gone raises an error naming the version and the feature that needs it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from torch import nn

import lightning_speedkit
from lightning_speedkit import _compat

PACKAGE = Path(lightning_speedkit.__file__).parent
ROOT = PACKAGE.parent
#: The one package that reads private names; everything in it is exempt from the scan.
COMPAT = PACKAGE / "_compat"
COMPAT_FILES = sorted(COMPAT.glob("*.py"))

# Private names of Python itself, not of torch or Lightning: allowed anywhere.
PYTHON_OWN = {
    "_current_frames": "sys._current_frames: HangWatchdog's stack dump of every thread",
    "_exit": "os._exit: HangWatchdog's abort, which must not wait for stuck threads",
    "_SubParsersAction": "argparse._SubParsersAction: the CLI's subparser type hints",
    "_asdict": "a namedtuple's public _asdict: FrozenFeatureCache reads a batch's fields",
}

# transformers' attention-selection attributes: the adapter's contract with transformers
# (not torch or Lightning), each read with getattr and a default, so a missing one
# degrades to "no fused kernel" rather than an error. Each entry: (path, private name);
# the test fails on an entry that no longer matches.
TEMPORARY = {
    ("lightning_speedkit/attention/adapters.py", "_supports_sdpa"),
    ("lightning_speedkit/attention/adapters.py", "_supports_flash_attn"),
    ("lightning_speedkit/attention/adapters.py", "_supports_flash_attn_2"),
    ("lightning_speedkit/attention/adapters.py", "_supports_flex_attn"),
    ("lightning_speedkit/attention/adapters.py", "_attn_implementation"),
    ("lightning_speedkit/attention/adapters.py", "_attn_implementation_internal"),
    ("lightning_speedkit/measure/_packed_check.py", "_attn_implementation"),
    # A layer's checkpoint function (`gradient_checkpointing_enable()`), wrapped during a
    # swapped call so that its recomputation runs the swap's attention.
    ("lightning_speedkit/attention/_hf_checkpointing.py", "_gradient_checkpointing_func"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --- the scan ------------------------------------------------------------------------------------


@functools.cache
def _privates_of(base: type) -> frozenset[str]:
    """A torch or Lightning class's private attributes and the ``self._x`` its source sets."""
    names = {name for name in vars(base) if _private(name) and name != "_abc_impl"}
    with contextlib.suppress(OSError, TypeError):  # a class without Python source
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(base)))
    return frozenset(names)


@functools.cache
def _inherited_privates(module_name: str, class_name: str) -> frozenset[str]:
    """Private names a kit class inherits from outside the kit."""
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not inspect.isclass(cls):
        return frozenset()
    outside = [
        base
        for base in cls.__mro__[1:]
        if not base.__module__.startswith("lightning_speedkit") and base is not object
    ]
    return frozenset().union(*(_privates_of(base) for base in outside))


class _Scan(ast.NodeVisitor):
    """Private names of other libraries that one module reads (path, line, name, code)."""

    def __init__(self, path: str, module_name: str, own: set[str]) -> None:
        self.path, self.module_name, self.own = path, module_name, own
        self.found: list[tuple[str, int, str, str]] = []
        self.classes: list[tuple[frozenset[str], set[str]]] = []  # (inherited, hooks checked)

    def _hit(self, node: ast.AST, name: str) -> None:
        code = ast.unparse(node).splitlines()[0]
        self.found.append((self.path, getattr(node, "lineno", 0), name, code))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        inherited: frozenset[str] = frozenset()
        if node.bases:
            inherited = _inherited_privates(self.module_name, node.name)
        checked = {
            call.args[1].value
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and ast.unparse(call.func) == "_compat.require_hook"
            and len(call.args) > 1
            and isinstance(call.args[1], ast.Constant)
        }
        self.classes.append((inherited, checked))
        for item in node.body:  # a private method that overrides Lightning's must be checked
            is_def = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_def and item.name in inherited and item.name not in checked:
                self._hit(item, item.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and not module.startswith("lightning_speedkit"):
            for part in module.split("."):
                if _private(part):
                    self._hit(node, module)
                    break
            for alias in node.names:
                if _private(alias.name):
                    self._hit(node, alias.name)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if any(_private(part) for part in alias.name.split(".")):
                self._hit(node, alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr):
            receiver = node.value
            on_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            on_super = isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super"
            if on_self or on_super:
                inherited, checked = self.classes[-1] if self.classes else (frozenset(), set())
                if node.attr in inherited and node.attr not in checked:
                    self._hit(node, node.attr)
            elif node.attr not in self.own:
                self._hit(node, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        reflective = isinstance(node.func, ast.Name) and node.func.id in (
            "getattr", "setattr", "hasattr", "delattr",
            "_private",  # _compat's getattr-or-raise
        )  # fmt: skip
        if reflective and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
            if isinstance(name, str) and _private(name) and name not in self.own:
                self._hit(node, name)
        self.generic_visit(node)


def _sources() -> Iterator[tuple[str, str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT)
        module_name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        yield relative.as_posix(), module_name, ast.parse(path.read_text(), str(path))


def _own_private_names(trees: list[ast.Module]) -> set[str]:
    """Private names the kit defines: functions, classes, variables, ``self._x``.

    A torch or Lightning name the kit only reads is none of these.
    """
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    # Attributes the kit puts on others' objects (a forward it wrapped, an optimizer it
    # switched) are named _speedkit...: never a torch or Lightning name.
    return {name for name in own if _private(name)}


def _kit_marker(name: str) -> bool:
    return name.startswith("_speedkit")


def scan(sources: list[tuple[str, str, ast.Module]]) -> list[tuple[str, int, str, str]]:
    """Every private name of another library read in ``sources``, the _compat package excepted."""
    compat = COMPAT.relative_to(ROOT).as_posix() + "/"
    own = _own_private_names([tree for path, _, tree in sources if not path.startswith(compat)])
    own -= _all_inherited(sources)
    found = []
    for path, module_name, tree in sources:
        if path.startswith(compat):
            continue
        visitor = _Scan(path, module_name, own)
        visitor.visit(tree)
        found += [hit for hit in visitor.found
                  if hit[2] not in PYTHON_OWN and not _kit_marker(hit[2])]  # fmt: skip
    return found


def _all_inherited(sources: list[tuple[str, str, ast.Module]]) -> set[str]:
    """Names kit classes inherit from outside: never the kit's own, even when it sets them."""
    names: set[str] = set()
    for _, module_name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.bases:
                names |= _inherited_privates(module_name, node.name)
    return names


def _temporary(path: str, name: str) -> tuple[str, str] | None:
    for where, allowed in TEMPORARY:
        if name == allowed and (path == where or (where.endswith("/") and path.startswith(where))):
            return where, allowed
    return None


@pytest.fixture(scope="module")
def findings() -> list[tuple[str, int, str, str]]:
    return scan(list(_sources()))


def test_no_private_torch_or_lightning_name_outside_compat(findings: list[Any]) -> None:
    """Pins the list: a private name read outside _compat/ fails here, by file:line."""
    new = [f"{path}:{line}: {code}" for path, line, name, code in findings
           if _temporary(path, name) is None]  # fmt: skip
    assert not new, (
        "private torch/Lightning names read outside lightning_speedkit/_compat/; put each "
        "behind a small function there (see its other functions):\n" + "\n".join(new)
    )


def test_temporary_allowances_still_needed(findings: list[Any]) -> None:
    used = {_temporary(path, name) for path, _, name, _ in findings}
    stale = sorted(TEMPORARY - used)
    assert not stale, f"no longer read there: delete these from TEMPORARY: {stale}"


@pytest.mark.parametrize(
    ("code", "name"),
    [
        ("def f(trainer):\n    return trainer._accelerator_connector\n", "_accelerator_connector"),
        ("import torch\nx = torch._C._get_tracing_state()\n", "_get_tracing_state"),
        ("from torch.utils._pytree import tree_map\n", "torch.utils._pytree"),
        ("from lightning.fabric.utilities.init import _materialize_meta\n", "_materialize_meta"),
        ("def f(s):\n    return getattr(s, '_layer_sync', None)\n", "_layer_sync"),
        (
            "from lightning.pytorch.strategies import DDPStrategy\n"
            "class S(DDPStrategy):\n    def setup(self, t):\n        return self._ddp_kwargs\n",
            "_ddp_kwargs",
        ),
        (  # an override of a Lightning private method the class does not check
            "from lightning.pytorch.strategies import DDPStrategy\n"
            "class S(DDPStrategy):\n    def _register_ddp_hooks(self):\n        pass\n",
            "_register_ddp_hooks",
        ),
    ],
)
def test_scan_finds_a_private_name(
    code: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan itself: each of these must be reported, or the pin above proves nothing."""
    (tmp_path / "probe_module.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = scan([("probe_module.py", "probe_module", ast.parse(code))])
    assert name in [hit[2] for hit in found]


def test_scan_passes_the_kit_own_and_checked_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = (
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "from lightning_speedkit import _compat\n"
        "class S(DDPStrategy):\n"
        "    def __init__(self):\n"
        "        _compat.require_hook(DDPStrategy, '_register_ddp_hooks', 'S')\n"
        "        self._mine = 1\n"
        "    def _register_ddp_hooks(self):\n"
        "        return super()._register_ddp_hooks(), self._mine, other._mine\n"
    )
    (tmp_path / "probe_ok.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert scan([("probe_ok.py", "probe_ok", ast.parse(code))]) == []


# --- every private name _compat reads, resolved on the installed versions -------------------------


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)  # fmt: skip


def _module_attribute(module: str, name: str) -> Callable[[], Any]:
    return lambda: getattr(importlib.import_module(module), name)


def _multiprocess_iterator_attr(name: str) -> Any:
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    return getattr(_MultiProcessingDataLoaderIter, name, None) or (
        name in _MultiProcessingDataLoaderIter.__init__.__code__.co_names or None
    )


def _attribute(owner: Callable[[], Any], name: str) -> Callable[[], Any]:
    return lambda: getattr(owner(), name)


def _saved(name: str) -> Callable[[], Any]:
    """What Lightning records of a loader made in a ``*_dataloader`` hook."""

    def reach() -> Any:
        from lightning.fabric.utilities.data import _replace_dunder_methods
        from torch.utils.data import DataLoader

        with _replace_dunder_methods(DataLoader, "dataset"):
            made = DataLoader(list(range(4)), 2)
        return getattr(made, name, None)

    return reach


# (what reads it, the private name as torch or Lightning spells it, how to reach it)
PRIVATE_NAMES: list[tuple[str, str, Callable[[], Any]]] = [
    # Lightning
    ("train_loader_source, change_train_loader, drop_train_loader_change", "_data_source",
     _attribute(lambda: _trainer().fit_loop, "_data_source")),
    ("change_train_loader, train_combined_loader", "_combined_loader",
     lambda: "_combined_loader" in vars(_trainer().fit_loop) or None),
    ("combined_loader_mode", "_mode",
     _attribute(lambda: L.pytorch.utilities.CombinedLoader([], "min_size"), "_mode")),
    ("logged_step", "_batches_that_stepped",
     _attribute(lambda: _trainer().fit_loop.epoch_loop, "_batches_that_stepped")),
    ("lightning_logs_now", "_logger_connector", _attribute(_trainer, "_logger_connector")),
    ("lightning_logs_now", "_should_accumulate",
     _attribute(lambda: _trainer().fit_loop.epoch_loop, "_should_accumulate")),
    ("change_train_loader", "_data_fetcher",
     lambda: "_data_fetcher" in vars(_trainer().fit_loop) or None),
    ("dataloader_built_again", "_replace_dunder_methods",
     _module_attribute("lightning.fabric.utilities.data", "_replace_dunder_methods")),
    ("dataloader_built_again", "__pl_saved_args", _saved("__pl_saved_args")),
    ("dataloader_built_again", "__pl_saved_kwargs", _saved("__pl_saved_kwargs")),
    ("dataloader_built_again", "__pl_saved_arg_names", _saved("__pl_saved_arg_names")),
    # torchmetrics (Lightning's)
    ("metric_state", "_defaults", _attribute(lambda: torchmetrics.SumMetric(), "_defaults")),
    ("before_batch_transfer", "_on_before_batch_transfer",
     _attribute(lambda: L.LightningModule(), "_on_before_batch_transfer")),
    ("take_over_accumulation", "_accumulated_batches_reached",
     _attribute(lambda: _trainer().fit_loop.epoch_loop, "_accumulated_batches_reached")),
    ("take_over_accumulation", "_make_zero_grad_fn",
     _attribute(lambda: _trainer().fit_loop.epoch_loop.automatic_optimization,
                "_make_zero_grad_fn")),
    ("ddp_kwargs", "_ddp_kwargs", _attribute(DDPStrategy, "_ddp_kwargs")),
    ("fsdp_state_dict_type", "_state_dict_type", _attribute(FSDPStrategy, "_state_dict_type")),
    ("set_data_parallel_only", "_data_parallel_size",
     _attribute(ModelParallelStrategy, "_data_parallel_size")),
    ("set_data_parallel_only", "_tensor_parallel_size",
     _attribute(ModelParallelStrategy, "_tensor_parallel_size")),
    ("materialize_distributed_module", "_materialize_distributed_module",
     _module_attribute("lightning.fabric.utilities.init", "_materialize_distributed_module")),
    ("optimizers_to_device", "_optimizers_to_device",
     _module_attribute("lightning.fabric.utilities.optimizer", "_optimizers_to_device")),
    ("init_deepspeed_distributed", "_init_deepspeed_distributed",
     lambda: DeepSpeedStrategy._init_deepspeed_distributed),
    # Lightning methods the kit's strategies override (checked by require_hook)
    ("require_hook: DDPPowerSGDStrategy, DDPHalfPrecisionStrategy", "_register_ddp_hooks",
     lambda: DDPStrategy._register_ddp_hooks),
    ("require_hook: FSDPZeRO2Strategy", "_setup_model", lambda: FSDPStrategy._setup_model),
    ("require_hook: DeepSpeedZeRO2Strategy", "_setup_model_and_optimizer",
     lambda: DeepSpeedStrategy._setup_model_and_optimizer),
    ("require_hook: FSDP2ZeRO2Strategy", "_configure_launcher",
     lambda: ModelParallelStrategy._configure_launcher),
    # torch
    ("default_process_group_store", "_get_default_store",
     _module_attribute("torch.distributed.distributed_c10d", "_get_default_store")),
    ("torch_profiler_enabled", "_profiler_enabled", lambda: torch.autograd._profiler_enabled),
    ("has_compiled_parts", "_dynamo", lambda: torch._dynamo.eval_frame.OptimizedModule),
    ("compiled_call_impl, has_compiled_parts", "_compiled_call_impl",
     lambda: "_compiled_call_impl" in vars(nn.Module) or None),
    ("compiled_and_eager_calls", "_call_impl", lambda: nn.Module._call_impl),
    ("dispatch_mode_active", "_C", lambda: torch._C._len_torch_dispatch_stack),
    ("dispatch_mode_active", "_len_torch_dispatch_stack",
     lambda: torch._C._len_torch_dispatch_stack),
    ("dispatch_modes_set_aside", "_disable_current_modes",
     _module_attribute("torch.utils._python_dispatch", "_disable_current_modes")),
    ("dynamo_callback_handler", "torch._dynamo.callback",
     _module_attribute("torch._dynamo.callback", "callback_handler")),
    ("compiled_by_lightning", "_compiler_ctx",
     lambda: "_compiler_ctx" in vars(L.LightningModule()) or None),
    ("dynamo_recompile_reasons", "torch._dynamo.utils",
     _module_attribute("torch._dynamo.utils", "get_compilation_metrics")),
    ("dynamo_compiled_code", "torch._dynamo.utils",
     _module_attribute("torch._dynamo.utils", "get_compilation_metrics")),
    ("dynamo_recompile_limit", "torch._dynamo",
     _module_attribute("torch._dynamo.config", "recompile_limit")),
    ("cpp_compiler", "torch._inductor",
     _module_attribute("torch._inductor.cpp_builder", "get_cpp_compiler")),
    ("foreach_kernel_devices", "torch.utils._foreach_utils",
     _module_attribute("torch.utils._foreach_utils", "_get_foreach_kernels_supported_devices")),
    ("foreach_kernel_devices", "_get_foreach_kernels_supported_devices",
     _module_attribute("torch.utils._foreach_utils", "_get_foreach_kernels_supported_devices")),
    ("powersgd_compresses", "_should_compress",
     _module_attribute("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
                       "_should_compress")),
    ("qualified_op_name", "_qualified_op_name", lambda: torch.ops.aten.mm._qualified_op_name),
    ("autograd_running", "_current_graph_task_id", lambda: torch._C._current_graph_task_id),
    ("current_autograd_node", "_current_autograd_node",
     lambda: torch._C._current_autograd_node),
    ("autograd_sequence_nr", "_autograd", lambda: torch._C._autograd),
    ("autograd_sequence_nr", "_get_sequence_nr", lambda: torch._C._autograd._get_sequence_nr),
    ("node_sequence_nr", "_sequence_nr",
     lambda: (torch.ones(1, requires_grad=True) * 2).grad_fn._sequence_nr),
    ("TorchDispatchMode (count_flops)", "torch.utils._python_dispatch",
     _module_attribute("torch.utils._python_dispatch", "TorchDispatchMode")),
    ("OpOverload (count_flops' annotations)", "torch._ops",
     _module_attribute("torch._ops", "OpOverload")),
    ("hook_dicts", "_forward_pre_hooks", _attribute(lambda: nn.Linear(1, 1), "_forward_pre_hooks")),
    ("hook_dicts", "_forward_pre_hooks_with_kwargs",
     _attribute(lambda: nn.Linear(1, 1), "_forward_pre_hooks_with_kwargs")),
    ("hook_dicts", "_forward_hooks", _attribute(lambda: nn.Linear(1, 1), "_forward_hooks")),
    ("hook_dicts", "_forward_hooks_always_called",
     _attribute(lambda: nn.Linear(1, 1), "_forward_hooks_always_called")),
    ("mha_same_embed_dim", "_qkv_same_embed_dim",
     _attribute(lambda: nn.MultiheadAttention(4, 1), "_qkv_same_embed_dim")),
    ("loader_iterator_workers", "_workers", lambda: _multiprocess_iterator_attr("_workers")),
    ("loader_iterator_workers", "_shutdown_workers",
     lambda: _multiprocess_iterator_attr("_shutdown_workers")),
    ("is_dataloader_iterator", "_BaseDataLoaderIter",
     _module_attribute("torch.utils.data.dataloader", "_BaseDataLoaderIter")),
    ("take_sampler_iterator", "_sampler_iter",
     _attribute(lambda: iter(torch.utils.data.DataLoader(list(range(4)))), "_sampler_iter")),
    ("train_loader_running, continue_train_epoch", "_iterator",
     _attribute(lambda: iter(L.pytorch.utilities.CombinedLoader([[1]], "max_size_cycle")),
                "_iterator")),
    ("tree_flatten_and_map", "torch.utils._pytree",
     _module_attribute("torch.utils._pytree", "tree_map")),
    ("make_wrapper_subclass", "_make_wrapper_subclass",
     lambda: torch.Tensor._make_wrapper_subclass),
    ("disable_torch_function_subclass", "DisableTorchFunctionSubclass",
     lambda: torch._C.DisableTorchFunctionSubclass),
    ("tensor_version", "_version", lambda: torch.ones(1)._version),
    ("report_worker_seed", "torch.utils.data._utils",
     lambda: importlib.import_module("torch.utils.data._utils.worker")),
    ("report_worker_seed", "_worker_info",  # None outside a worker: the name is what counts
     lambda: "_worker_info" in vars(importlib.import_module("torch.utils.data._utils.worker"))
     or None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("reader", "name", "reach"), PRIVATE_NAMES, ids=[f"{n}-{r}" for r, n, _ in PRIVATE_NAMES]
)
def test_private_name_resolves(reader: str, name: str, reach: Callable[[], Any]) -> None:
    """Fails on the torch or Lightning upgrade that removes a name _compat reads."""
    assert reach() is not None, f"{name} ({reader}) is None"


def test_table_lists_every_private_name_compat_reads() -> None:
    """The table above is complete: a private name added to _compat/ must join it."""
    trees = {path: ast.parse(path.read_text()) for path in COMPAT_FILES}
    own = _own_private_names(list(trees.values()))
    read = set()
    for path, tree in trees.items():
        visitor = _Scan(path.name, f"lightning_speedkit._compat.{path.stem}", own)
        visitor.visit(tree)
        read |= {name for _, _, name, _ in visitor.found}
    hooks = {
        call.args[1].value
        for _, _, module in _sources()
        for call in ast.walk(module)
        if isinstance(call, ast.Call)
        and ast.unparse(call.func) == "_compat.require_hook"
        and isinstance(call.args[1], ast.Constant)
    }
    listed = {name for _, name, _ in PRIVATE_NAMES}
    assert read | hooks <= listed, f"add to PRIVATE_NAMES: {sorted((read | hooks) - listed)}"
    assert hooks, "no strategy checks its Lightning hooks: the scan of require_hook is broken"
    assert len(read) > 10, f"the scan of _compat/ found only {sorted(read)}: it is broken"


# --- a name that is gone -------------------------------------------------------------------------


def test_missing_hook_names_the_version_and_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_speedkit import DDPPowerSGDStrategy

    monkeypatch.delattr(DDPStrategy, "_register_ddp_hooks")
    with pytest.raises(RuntimeError) as info:
        DDPPowerSGDStrategy()
    message = str(info.value)
    assert f"Lightning ({L.__version__})" in message
    assert "`DDPStrategy._register_ddp_hooks`" in message
    assert "DDPPowerSGDStrategy" in message


def test_missing_powersgd_helper_names_the_version_and_the_feature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    assert _compat.powersgd_compresses(64, 64, 1, 2.0)  # present: torch's own answer
    assert not _compat.powersgd_compresses(1, 64, 1, 2.0)  # a bias row does not shrink
    monkeypatch.delattr(powerSGD_hook, "_should_compress")
    with pytest.raises(RuntimeError, match=rf"torch \({re.escape(torch.__version__)}\)") as info:
        _compat.powersgd_compresses(64, 64, 1, 2.0)
    assert "powerSGD_hook._should_compress" in str(info.value)
    assert "DDPPowerSGDStrategy" in str(info.value)


def test_missing_ddp_kwargs_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = DDPStrategy(find_unused_parameters=True)
    assert _compat.ddp_kwargs(strategy) == {"find_unused_parameters": True}
    monkeypatch.delattr(strategy, "_ddp_kwargs")
    with pytest.raises(RuntimeError, match=r"Lightning \(.*`DDPStrategy._ddp_kwargs`"):
        _compat.ddp_kwargs(strategy)


def test_the_recompile_limit_is_read_live_and_a_missing_one_names_the_feature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._dynamo import config

    assert _compat.dynamo_recompile_limit() == config.recompile_limit
    with config.patch(recompile_limit=3):  # set by the user after the callback was made
        assert _compat.dynamo_recompile_limit() == 3
    monkeypatch.setattr(torch._dynamo, "config", object())  # a torch without the setting
    with pytest.raises(RuntimeError, match=rf"torch \({re.escape(torch.__version__)}\)") as info:
        _compat.dynamo_recompile_limit()
    assert "`torch._dynamo.config.recompile_limit`" in str(info.value)
    assert "RegionalCompile" in str(info.value)
