"""Processes, devices and reductions for `torchrun` data parallelism (PyTorch DDP or FSDP2, `train.system.parallel`:
NCCL on GPUs, gloo on CPU; the sharding itself is `loopformer.train.sharding`).

A plain `python` launch is a world of one process and every helper is a no-op there. Under
`torchrun --nproc_per_node=N`, `RANK`, `WORLD_SIZE` and `LOCAL_RANK` are set; each process takes its slice of
every global batch (see `loopformer.sources`) and only rank 0 logs and writes files.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loopformer.device import pick_device
from loopformer.errors import UserError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    sharded: bool = False        # train.system.parallel=fsdp: the model is sharded over the processes (FSDP2)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


MAX_WORLD = 1 << 16          # processes a launch may name (WORLD_SIZE)
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 7):
        raise UserError(f"the environment's {name}={raw[:40]!r} is not a process count or index (a non-negative "
                        f"integer, as torchrun sets it); unset it or launch with torchrun")
    return int(text)


def launch_env(joins: bool = False) -> tuple[int, int, int]:
    """(WORLD_SIZE, RANK, LOCAL_RANK) as torchrun set them ((1, 0, 0) when not launched by torchrun), checked before
    any work: integers with 1 <= WORLD_SIZE <= 65,536 and both ranks below it; a launch that joins a process group
    (WORLD_SIZE > 1, or `joins`: a sharded run even as a world of one) needs the rendezvous variables MASTER_ADDR and
    MASTER_PORT (1..65,535). Anything else is a one-line UserError."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", 0)
    if not 1 <= world <= MAX_WORLD:
        raise UserError(f"the environment's WORLD_SIZE={world} must be 1..{MAX_WORLD:,} processes")
    for name, value in (("RANK", rank), ("LOCAL_RANK", local)):
        if value >= world:
            raise UserError(f"the environment's {name}={value} must be below WORLD_SIZE={world}")
    if world > 1 or joins:
        missing = [n for n in _RENDEZVOUS if not os.environ.get(n, "").strip()]
        if missing:
            raise UserError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')} joins a process group, which needs "
                            f"{' and '.join(missing)} in the environment (torchrun sets them: launch with torchrun "
                            f"--nproc_per_node=N -m loopformer.cli train ...)")
        port = os.environ["MASTER_PORT"].strip()
        if not (port.isascii() and port.isdigit() and 1 <= int(port[:6]) <= 65535):
            raise UserError(f"the environment's MASTER_PORT={port[:40]!r} must be a port number 1..65,535")
    return world, rank, local


def launch_rank() -> int:
    """This process's rank as torchrun set it (`RANK`; 0 when not launched by torchrun), before any group exists;
    the launch's environment is checked (`launch_env`)."""
    return launch_env()[1]


def setup(device_choice: str = "auto", sharded: bool = False) -> Dist:
    """Join the process group when launched by torchrun (once per process); pick this process's device.
    `sharded` (train.system.parallel=fsdp) needs torchrun's launch and joins its group even as a world of one.
    The launch's environment is checked first (`launch_env`)."""
    if sharded and "WORLD_SIZE" not in os.environ:
        raise UserError("train.system.parallel=fsdp shards the model over torchrun's processes: launch with "
                        "torchrun --nproc_per_node=N -m loopformer.cli train ... (N >= 1), or use "
                        "train.system.parallel=ddp")
    world, rank, local = launch_env(joins=sharded)
    device = pick_device(device_choice, local)
    if (world > 1 or sharded) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    return Dist(rank=rank, world=world, local_rank=local, device=device, sharded=sharded)


def teardown() -> None:
    """Leave the process group. Modules wrapped by DDP / FSDP keep references to the group's communicator and often
    sit in reference cycles; collected at interpreter exit, gloo's worker threads can then abort the process
    ('terminate called without an active exception'). So cycles are collected first, while the interpreter is whole,
    then every process meets at a barrier and the group is destroyed."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_sum(d: Dist, values: list[float]) -> list[float]:
    """Element-wise sum of a list of numbers over all processes (float64, on the process's device)."""
    if not d.active:
        return [float(v) for v in values]
    dev = d.device if d.device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.tolist()


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def gather_objects(d: Dist, obj: Any) -> list[Any]:
    """Every process's `obj`, in rank order (on every process)."""
    if not d.active:
        return [obj]
    out: list[Any] = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(d: Dist, obj: Any) -> Any:
    """Rank 0's `obj` on every process."""
    if not d.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
