"""Every place the kit reads something torch or Lightning does not offer publicly, in one package.

Private names (a leading underscore, reached from torch, Lightning or DeepSpeed) are read
here and nowhere else in the package; tests/test_compat.py scans the package to keep it so,
and checks that every name read here resolves on the installed versions. A name gone from
an installed version raises an error that says which, and which feature needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_speedkit._compat._lightning_loop import add_callback_once as add_callback_once
from lightning_speedkit._compat._lightning_loop import (
    before_batch_transfer as before_batch_transfer,
)
from lightning_speedkit._compat._lightning_loop import change_train_loader as change_train_loader
from lightning_speedkit._compat._lightning_loop import combined_loader_mode as combined_loader_mode
from lightning_speedkit._compat._lightning_loop import (
    dataloader_built_again as dataloader_built_again,
)
from lightning_speedkit._compat._lightning_loop import datamodule as datamodule
from lightning_speedkit._compat._lightning_loop import (
    default_process_group_store as default_process_group_store,
)
from lightning_speedkit._compat._lightning_loop import (
    drop_train_loader_change as drop_train_loader_change,
)
from lightning_speedkit._compat._lightning_loop import has_compiled_parts as has_compiled_parts
from lightning_speedkit._compat._lightning_loop import lightning_logs_now as lightning_logs_now
from lightning_speedkit._compat._lightning_loop import logged_step as logged_step
from lightning_speedkit._compat._lightning_loop import metric_state as metric_state
from lightning_speedkit._compat._lightning_loop import (
    reload_train_loader_next_epoch as reload_train_loader_next_epoch,
)
from lightning_speedkit._compat._lightning_loop import (
    take_over_accumulation as take_over_accumulation,
)
from lightning_speedkit._compat._lightning_loop import (
    torch_profiler_enabled as torch_profiler_enabled,
)
from lightning_speedkit._compat._lightning_loop import (
    train_combined_loader as train_combined_loader,
)
from lightning_speedkit._compat._lightning_loop import train_loader_source as train_loader_source
from lightning_speedkit._compat._lightning_loop import trains_no_batch as trains_no_batch
from lightning_speedkit._compat._modules_and_loaders import (
    continue_train_epoch as continue_train_epoch,
)
from lightning_speedkit._compat._modules_and_loaders import (
    disable_torch_function_subclass as disable_torch_function_subclass,
)
from lightning_speedkit._compat._modules_and_loaders import hook_dicts as hook_dicts
from lightning_speedkit._compat._modules_and_loaders import (
    is_dataloader_iterator as is_dataloader_iterator,
)
from lightning_speedkit._compat._modules_and_loaders import (
    loader_iterator_workers as loader_iterator_workers,
)
from lightning_speedkit._compat._modules_and_loaders import (
    make_wrapper_subclass as make_wrapper_subclass,
)
from lightning_speedkit._compat._modules_and_loaders import mha_same_embed_dim as mha_same_embed_dim
from lightning_speedkit._compat._modules_and_loaders import (
    report_worker_seed as report_worker_seed,
)
from lightning_speedkit._compat._modules_and_loaders import (
    reuses_its_workers as reuses_its_workers,
)
from lightning_speedkit._compat._modules_and_loaders import (
    take_sampler_iterator as take_sampler_iterator,
)
from lightning_speedkit._compat._modules_and_loaders import tensor_version as tensor_version
from lightning_speedkit._compat._modules_and_loaders import (
    train_loader_running as train_loader_running,
)
from lightning_speedkit._compat._modules_and_loaders import (
    tree_flatten_and_map as tree_flatten_and_map,
)
from lightning_speedkit._compat._torch_internals import TorchDispatchMode as TorchDispatchMode
from lightning_speedkit._compat._torch_internals import autograd_running as autograd_running
from lightning_speedkit._compat._torch_internals import autograd_sequence_nr as autograd_sequence_nr
from lightning_speedkit._compat._torch_internals import (
    compiled_and_eager_calls as compiled_and_eager_calls,
)
from lightning_speedkit._compat._torch_internals import (
    compiled_by_lightning as compiled_by_lightning,
)
from lightning_speedkit._compat._torch_internals import compiled_call_impl as compiled_call_impl
from lightning_speedkit._compat._torch_internals import cpp_compiler as cpp_compiler
from lightning_speedkit._compat._torch_internals import (
    current_autograd_node as current_autograd_node,
)
from lightning_speedkit._compat._torch_internals import ddp_kwargs as ddp_kwargs
from lightning_speedkit._compat._torch_internals import dispatch_mode_active as dispatch_mode_active
from lightning_speedkit._compat._torch_internals import (
    dispatch_modes_set_aside as dispatch_modes_set_aside,
)
from lightning_speedkit._compat._torch_internals import (
    dynamo_callback_handler as dynamo_callback_handler,
)
from lightning_speedkit._compat._torch_internals import (
    dynamo_compiled_code as dynamo_compiled_code,
)
from lightning_speedkit._compat._torch_internals import (
    dynamo_recompile_limit as dynamo_recompile_limit,
)
from lightning_speedkit._compat._torch_internals import (
    dynamo_recompile_reasons as dynamo_recompile_reasons,
)
from lightning_speedkit._compat._torch_internals import (
    foreach_kernel_devices as foreach_kernel_devices,
)
from lightning_speedkit._compat._torch_internals import fsdp_state_dict_type as fsdp_state_dict_type
from lightning_speedkit._compat._torch_internals import (
    init_deepspeed_distributed as init_deepspeed_distributed,
)
from lightning_speedkit._compat._torch_internals import (
    materialize_distributed_module as materialize_distributed_module,
)
from lightning_speedkit._compat._torch_internals import node_sequence_nr as node_sequence_nr
from lightning_speedkit._compat._torch_internals import optimizers_to_device as optimizers_to_device
from lightning_speedkit._compat._torch_internals import powersgd_compresses as powersgd_compresses
from lightning_speedkit._compat._torch_internals import qualified_op_name as qualified_op_name
from lightning_speedkit._compat._torch_internals import require_hook as require_hook
from lightning_speedkit._compat._torch_internals import set_compiled_call as set_compiled_call
from lightning_speedkit._compat._torch_internals import (
    set_data_parallel_only as set_data_parallel_only,
)

if TYPE_CHECKING:
    from torch._ops import OpOverload as OpOverload  # the operators a dispatch mode sees
