"""Processes of a training run: torchrun's environment, the device, collective helpers, and
SIGINT/SIGTERM handling that lets the step in flight finish and checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash_audit.train.setup import TrainError


class StopSignals:
    """Context manager: SIGINT/SIGTERM set :attr:`received` instead of killing the process,
    so the loop can finish the step and checkpoint. Handlers are restored on exit."""

    def __init__(self) -> None:
        self.received: int = 0
        self._old: dict[int, Any] = {}

    def _handler(self, signum, _frame) -> None:
        self.received = signum

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistEnv:
    """Read torchrun's environment; initialize the process group when ``WORLD_SIZE`` > 1
    (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    env = DistEnv(rank=int(os.environ.get("RANK", "0")), world_size=world,
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return env


def resolve_device(requested: str, env: DistEnv) -> torch.device:
    """``auto`` -> CUDA (this rank's GPU) when available, else CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise TrainError("--device cuda, but torch sees no GPU; use --device cpu")
        return torch.device("cuda", env.local_rank)
    return torch.device(requested)


def _all_reduce_sum(values: dict[str, float], env: DistEnv) -> dict[str, float]:
    if not env.distributed:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def _all_max(value: int, env: DistEnv) -> int:
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _gather(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def release_group(env: DistEnv) -> None:
    """Tear the process group down at the end of a run (also after an error): garbage first
    (DDP's reducer holds the group), then a barrier, then ``destroy_process_group``; nothing
    outside torchrun."""
    if env.distributed and dist.is_initialized():
        import gc

        gc.collect()
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
