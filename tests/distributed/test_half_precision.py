"""half_precision_hook without a Trainer, and the import paths the split kept."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.distributed import half_precision
from lightning_speedkit.distributed.half_precision import half_precision_hook


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_a_dtype_other_than_fp16_or_bf16_is_refused_with_the_choices(dtype: str | None) -> None:
    with pytest.raises(SpeedkitConfigError) as caught:
        half_precision_hook(dtype)  # type: ignore[arg-type]
    shown = "'fp32' (a string)" if dtype else "None"
    assert str(caught.value) == (
        f"`dtype` is not one of the choices, got {shown}; pass one of 'fp16', 'bf16'."
    )


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process (an in-memory store, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()  # DDP's reducer holds the group: finalize it here, not in a later fork


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_gradients_travel_in_half_precision_on_gloo(dtype: str, torch_dtype: torch.dtype) -> None:
    """One rank: the all-reduced gradient is the gradient rounded to ``dtype`` and back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    model(x).pow(2).sum().backward()
    assert model.weight.grad is not None
    exact = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, half_precision_hook(dtype))  # type: ignore[arg-type]
    ddp(x).pow(2).sum().backward()
    sent = model.weight.grad
    assert sent is not None
    assert torch.equal(sent, exact.to(torch_dtype).float())
    assert not torch.equal(sent, exact)  # the rounding really happened


def test_the_names_powersgd_exported_before_the_split_still_import() -> None:
    from lightning_speedkit.distributed.powersgd import (
        DDPHalfPrecisionStrategy,
        DDPPowerSGDStrategy,
        check_ddp_kwargs,
    )
    from lightning_speedkit.distributed.powersgd import (
        half_precision_hook as from_powersgd,
    )

    assert DDPHalfPrecisionStrategy is half_precision.DDPHalfPrecisionStrategy
    assert from_powersgd is half_precision_hook
    assert DDPPowerSGDStrategy.__module__ == "lightning_speedkit.distributed.powersgd"
    with pytest.raises(SpeedkitConfigError, match="`bucket_cap`"):
        check_ddp_kwargs("DDPPowerSGDStrategy", {"bucket_cap": 25})
