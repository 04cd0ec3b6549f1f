"""PowerSGD's state kept by parameter: the Trainer-free core of ``DDPPowerSGDStrategy``.

torch keys PowerSGD's state (error feedback, warm-start P and Q) by DDP bucket index,
and DDP lays its buckets out anew in every process (first in reverse parameter order,
then, after one iteration, in gradient-ready order). :class:`_ParameterBook` holds the
same state by parameter name: before torch's ``powerSGD_hook`` sees a bucket it lays
the state out for that bucket's parameters (:meth:`_ParameterBook.on_bucket`), it draws
the initial factors per parameter (:meth:`_ParameterBook.draw_if_due`), and it exports
and restores the state per parameter (:meth:`_ParameterBook.export`,
:meth:`_ParameterBook.restore`) in types ``torch.load(weights_only=True)`` accepts.
:func:`_speedkit_powersgd_hook` is the hook DDP calls: the book, then torch's hook.

Nothing here needs a Trainer; a bucket is anything with ``index()``, ``parameters()``
and ``buffer()``.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_speedkit import _compat
from lightning_speedkit.distributed._kit_ddp import GradBucket, _comm_hook

_Layout = tuple[tuple[str, tuple[int, ...]], ...]  # (parameter name, shape) in bucket order


class _ParameterBook:
    """PowerSGD's per-bucket state, viewed and stored per parameter.

    It also draws the random initial factors, per parameter (:meth:`draw_if_due`), where
    torch's hook would draw them per bucket: torch seeds each bucket's draws in turn,
    so a matrix's factors depend on where DDP's buckets put it, and DDP lays buckets
    out in registration order for a process's first iteration and in gradient-ready
    order after it. A run resumed at its first compressed iteration (a checkpoint at
    ``start_iter``), or any resume without warm start, then drew other factors than
    the run it continues. ``warm_start`` is the strategy's: torch's state is told to
    warm-start always, and without warm start the factors are drawn afresh here at
    every compressed iteration.
    """

    def __init__(
        self, state: PowerSGDState, names: dict[int, str], seed: int = 0, warm_start: bool = True
    ) -> None:
        self.state = state
        self.names = names  # id(parameter) -> name
        self.seed = seed
        self.warm_start = warm_start
        state.warm_start = True  # the hook reuses what _draw put in its memory
        self.layouts: dict[int, _Layout] = {}  # bucket index -> its parameters now
        self._ids: dict[int, tuple[int, ...]] = {}  # the same, as ids: the per-step check
        self.pending: dict[str, dict[str, Tensor]] = {}  # name -> {"error", "p", "q"}
        self.calls = 0
        self.rank_changed = False  # restored factors of another rank were dropped

    def _compressed(self, layout: _Layout) -> list[tuple[str, int, int, int]]:
        """(name, rows, cols, rank) of the compressed matrices, in the order of P and Q memory.

        As powerSGD_hook lays them out: grouped by shape, groups in order of first
        appearance, tensors within a group in bucket order.
        """
        groups: dict[tuple[int, int], list[str]] = defaultdict(list)
        for name, shape in layout:
            n = shape[0] if shape else 1
            m = int(np.prod(shape)) // n if n else 0
            r = min(n, m, self.state.matrix_approximation_rank)
            if _compat.powersgd_compresses(n, m, r, self.state.min_compression_rate):
                groups[(n, m)].append(name)
        return [(name, n, m, min(n, m, self.state.matrix_approximation_rank))
                for (n, m), names in groups.items() for name in names]  # fmt: skip

    def _split(self, index: int, layout: _Layout) -> dict[str, dict[str, Tensor]]:
        pieces: dict[str, dict[str, Tensor]] = defaultdict(dict)
        error = self.state.error_dict.get(index)
        if error is not None:
            offset = 0
            for name, shape in layout:
                numel = int(np.prod(shape)) if shape else 1
                pieces[name]["error"] = error[offset : offset + numel]
                offset += numel
        p_mem, q_mem = self.state.p_memory_dict.get(index), self.state.q_memory_dict.get(index)
        if p_mem is not None and q_mem is not None:
            p_off = q_off = 0
            for name, n, m, r in self._compressed(layout):
                pieces[name]["p"] = p_mem[p_off : p_off + n * r]
                pieces[name]["q"] = q_mem[q_off : q_off + m * r]
                p_off, q_off = p_off + n * r, q_off + m * r
        return dict(pieces)

    def _assemble(self, index: int, layout: _Layout, like: Tensor) -> None:
        """Rebuild this bucket's state from per-parameter pieces, if all of them are there."""
        names = [name for name, _ in layout]
        if self.state.use_error_feedback and all("error" in self.pending.get(n, {}) for n in names):
            self.state.error_dict[index] = torch.cat(
                [self.pending[n].pop("error").to(like) for n in names]
            )
        compressed = self._compressed(layout)
        for name, n, m, r in compressed:  # factors saved at another rank cannot be reused
            piece = self.pending.get(name, {})
            sizes = {"p": n * r, "q": m * r}
            if any(key in piece and piece[key].numel() != sizes[key] for key in sizes):
                piece.pop("p", None), piece.pop("q", None)
                if not self.rank_changed:
                    self.rank_changed = True
                    rank_zero_warn(
                        f"DDPPowerSGDStrategy: the checkpoint's warm-start factors were made at "
                        f"another `rank` than this run's {self.state.matrix_approximation_rank}; "
                        f"they start afresh (error feedback and the iteration count are kept)."
                    )
        if compressed and all({"p", "q"} <= set(self.pending.get(n, {})) for n, *_ in compressed):
            self.state.p_memory_dict[index] = torch.cat(
                [self.pending[n].pop("p").to(like) for n, *_ in compressed]
            )
            self.state.q_memory_dict[index] = torch.cat(
                [self.pending[n].pop("q").to(like) for n, *_ in compressed]
            )

    def _unpack_all(self) -> None:
        """Move all bucket state into per-parameter pieces (before buckets change)."""
        for index, layout in self.layouts.items():
            for name, piece in self._split(index, layout).items():
                self.pending.setdefault(name, {}).update({k: v.clone() for k, v in piece.items()})
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts.clear()
        self._ids.clear()

    def on_bucket(self, bucket: GradBucket) -> None:
        """Called before PowerSGD sees ``bucket``: make the state match its layout."""
        self.calls += 1
        index = bucket.index()
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        if self._ids.get(index) == ids:  # the usual case: nothing moved since last step
            return
        self._ids[index] = ids
        layout = tuple((self.names[id(p)], tuple(p.shape)) for p in params)
        if index in self.layouts:  # DDP re-laid its buckets: re-key everything by parameter
            self._unpack_all()
        self.layouts[index] = layout
        if self.pending:
            self._assemble(index, layout, bucket.buffer())

    def draw_if_due(self, bucket: GradBucket) -> None:
        """Random factors for the bucket when the hook is about to compress it without any."""
        index, state = bucket.index(), self.state
        if state.iter < state.start_powerSGD_iter:
            return
        if self.warm_start and index in state.p_memory_dict:
            return
        like = bucket.buffer()  # drawn on its device: no copy from the host, each step
        ps: list[Tensor] = [torch.zeros(0, device=like.device)]
        qs: list[Tensor] = [torch.zeros(0, device=like.device)]
        for name, n, m, r in self._compressed(self.layouts[index]):
            # The same on every rank, whatever the bucket; the hook orthogonalizes Q.
            step = 0 if self.warm_start else int(state.iter)
            key = (self.seed << 32 | zlib.crc32(name.encode())) ^ (step * 0x9E3779B97F4A7C15)
            generator = torch.Generator(device=like.device).manual_seed(key % 2**63)
            qs.append(torch.randn(m * r, generator=generator, device=like.device))
            ps.append(torch.zeros(n * r, device=like.device))
        state.p_memory_dict[index] = torch.cat(ps).to(like.dtype)
        state.q_memory_dict[index] = torch.cat(qs).to(like.dtype)

    def export(self) -> dict[str, Any]:
        """Every parameter's state, on CPU, in types ``torch.load(weights_only=True)`` accepts."""
        params: dict[str, dict[str, Tensor]] = {
            name: {k: v.detach().cpu().clone() for k, v in piece.items()}
            for name, piece in self.pending.items()
        }
        for index, layout in self.layouts.items():
            for name, piece in self._split(index, layout).items():
                params.setdefault(name, {}).update(
                    {k: v.detach().cpu().clone() for k, v in piece.items()}
                )
        _, keys, pos, has_gauss, cached = self.state.rng.get_state()
        return {
            "iter": int(self.state.iter),
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "numel_before": int(self.state.total_numel_before_compression),
            "numel_after": int(self.state.total_numel_after_compression),
            "params": params,
        }

    def restore(self, data: dict[str, Any]) -> None:
        """Take back what :meth:`export` gave; bucket state is laid out at the next buckets."""
        self.state.iter = int(data["iter"])
        rng = data["rng"]
        self.state.rng.set_state(
            ("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
             rng["cached_gaussian"])
        )  # fmt: skip
        self.state.total_numel_before_compression = int(data["numel_before"])
        self.state.total_numel_after_compression = int(data["numel_after"])
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts.clear()
        self._ids.clear()
        self.pending = {name: dict(piece) for name, piece in data["params"].items()}


class _HookState:
    """What the registered hook carries: torch's PowerSGDState and our parameter book.

    ``serialize``: finish each bucket's compression before returning. PowerSGD issues
    its second and third all-reduces from the first one's completion callback. NCCL
    runs those in stream order; gloo runs callbacks on its own threads, so with several
    buckets in flight two ranks can issue their collectives in different orders and
    wait for each other for ever (seen with a 64 MiB model over a veth link). Waiting
    per bucket on gloo keeps the order; it gives up overlapping communication with the
    rest of the backward pass, which a CPU run has little of anyway.
    """

    def __init__(self, powersgd: PowerSGDState, book: _ParameterBook, serialize: bool) -> None:
        self.powersgd = powersgd
        self.book = book
        self.serialize = serialize

    def __getstate__(self) -> dict[str, Any]:  # DDP may pickle hook states; the book stays here
        return {"powersgd": self.powersgd, "serialize": self.serialize}


@_comm_hook
def _speedkit_powersgd_hook(state: _HookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    state.book.on_bucket(bucket)
    state.book.draw_if_due(bucket)
    future = powerSGD_hook(state.powersgd, bucket)
    if not state.serialize:
        return future
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(future.wait())  # see _HookState: collective order on gloo
    return done
