"""Sharded data parallelism for looped models (PyTorch FSDP2) and its distributed checkpoints (DCP).

`train.system.parallel=fsdp` under `torchrun`: every process holds 1/N of each parameter, of its gradient and of both
AdamW moments (`torch.distributed.fsdp.fully_shard`, one parameter group per layer of the shared block and one for the
rest: embeddings, timestep embedder, final norm, head, exit gate). A parameter is all-gathered when its group runs
and its gradient reduce-scattered (averaged, as DDP's all-reduce) after the backward.

The loop is the case default sharding gets wrong: the shared block runs r times per forward, and FSDP's defaults
(reshard after every call, and after every call's backward) all-gather its parameters 2r times per step. Here every
group is gathered once per step and kept until the step's gradients are reduced (`reshard_after_forward=False`,
`set_reshard_after_backward(False)`, then `reshard` before the optimiser step): one all-gather and one
reduce-scatter per group and step, whatever r, for the memory of one unsharded block
(`benchmarks/bench_distributed.py` counts them). Block methods that run outside its `forward` (the timestep
modulation of every loop, the last loop's read-only positions, the cache's prepared modulations) are registered so
they gather too.

Checkpoints: the sharded weights, optimiser state and weight average are written by every process into the
checkpoint's `sharded/` folder (`torch.distributed.checkpoint`: one file per process and a metadata file) and read
back on any number of processes (the planner reshards). Rank 0 also writes the full weights as `model.safetensors`
(and `ema.safetensors`) with config.json, so `loopformer.load`, `eval` and `generate` read an FSDP run's checkpoint
as any other; `export_sharded` rebuilds those files from `sharded/` alone, without processes.

Evaluation and the dynamics records run on rank 0 on a replica holding the full weights, gathered once per step
they are needed (`full_state`): an unsharded copy of the parameters on rank 0, no optimiser state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loopformer.errors import UserError

SHARDED = "sharded"                  # the DCP folder inside a checkpoint folder
BLOCK_METHODS = ("loop_modulation", "forward_at", "prepare")   # block methods the loop calls outside `forward`
_VIEW_WARNING = "FSDP2-wrapped module .* returned a view tensor"


def _fsdp():
    """torch.distributed.fsdp's FSDP2 names, imported on first use (heavy)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    return FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def _checkpoint_exception() -> type[BaseException]:
    """DCP's error type (a BaseException: `except Exception` does not catch it)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` was sharded by `shard_model` (FSDP2 changes the module's class in place)."""
    return isinstance(model, _fsdp()[0])


def shard_model(model: torch.nn.Module, device: torch.device, precision: str) -> None:
    """Shard a LoopedTransformer in place over the default process group: each layer of the shared block a group of
    its own, the root the rest; parameters gathered once per step (see the module docstring). `precision` "bf16" on
    a CUDA device keeps bf16 parameters for the forward and backward with fp32 gradient reductions (the sharded
    master weights stay fp32); anything else trains in fp32."""
    FSDPModule, MixedPrecisionPolicy, fully_shard, register_method = _fsdp()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device.type == "cuda" and precision == "bf16" else MixedPrecisionPolicy())
    # the blocks' outputs feed out-of-place residual sums only: FSDP's warning about returned views does not apply
    warnings.filterwarnings("ignore", message=_VIEW_WARNING)
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=False, mp_policy=mp)
        for name in BLOCK_METHODS:
            if hasattr(blk, name):
                register_method(blk, name)
    # the root's parameters stay gathered after its forward too: the exit gate's and the Jacobian's losses call its
    # modules after the forward
    fully_shard(model, reshard_after_forward=False, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_backward(False)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every group (after the step's last backward, before the optimiser updates
    the shards: the next forward gathers the new values)."""
    FSDPModule = _fsdp()[0]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@contextlib.contextmanager
def gradient_sync(net: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Reduce the gradients of this backward across processes only if `sync` (gradient accumulation: the earlier
    micro-batches accumulate locally): DDP's `no_sync`, FSDP's `set_requires_gradient_sync`."""
    if sync or not dist.is_initialized():
        yield
    elif is_sharded(net):
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    elif hasattr(net, "no_sync"):
        with net.no_sync():
            yield
    else:
        yield


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a DTensor), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (or partial) DTensor, gathered on every process; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a sharded model on rank 0, on the CPU (every process must call it; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_tensors(tensors: dict[str, torch.Tensor], main: bool) -> dict[str, torch.Tensor]:
    """{name: the whole tensor on the CPU} on rank 0 (`main`), {} elsewhere; every process must call it."""
    out = {}
    for name, t in tensors.items():
        whole = full(t).detach().cpu()
        if main:
            out[name] = whole
    return out


# ------------------------------------------------------------------------------------------------- checkpoints
def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> dict[str, Any]:
    """The sharded state DCP writes and reads: {"model", "optim"(, "ema")}."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    if ema is not None:
        state["ema"] = ema
    return state


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ema: dict | None = None) -> None:
    """Write the sharded weights, optimiser state (and weight average `ema`: {name: sharded tensor}) of every
    process into `folder` (every process calls it with the same folder)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(_state(model, optimizer, ema), checkpoint_id=str(folder))


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ema: dict | None = None) -> None:
    """Read `save_sharded`'s folder into a sharded model, its optimiser (and `ema`, in place) on any number of
    processes; a folder that is missing, incomplete or of another model is a one-line UserError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    if not (folder / ".metadata").is_file():
        raise UserError(f"cannot resume: {folder} holds no sharded checkpoint (its .metadata is missing)")
    state = _state(model, optimizer, ema)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - any failure to read the folder
        raise UserError(f"cannot resume from {folder}: {_first_line(exc)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _first_line(exc: BaseException) -> str:
    """The informative line of an exception: DCP reports each process's error as a traceback, whose last line is
    the error itself (a missing shard: "FileNotFoundError: ... __1_0.distcp")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def read_sharded(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of `save_sharded`'s folder, whole, in one process without a process group:
    {"model": {...}, "ema": {...}} (the optimiser state is left out). Errors are one-line UserErrors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not (folder / ".metadata").is_file():
        raise UserError(f"{folder} holds no sharded checkpoint (its .metadata is missing)")
    try:
        reader = dcp.FileSystemReader(str(folder))
        meta = reader.read_metadata()
        want: dict[str, Any] = {}
        for key, item in meta.state_dict_metadata.items():
            group, _, name = key.partition(".")
            if group in ("model", "ema") and isinstance(item, TensorStorageMetadata):
                want.setdefault(group, {})[name] = torch.empty(item.size, dtype=item.properties.dtype)
        dcp.load(want, storage_reader=reader, no_dist=True)
    except UserError:
        raise
    except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - a missing or damaged shard, a foreign folder
        raise UserError(f"cannot read the sharded checkpoint {folder}: {_first_line(exc)}") from None
    return want


def export_sharded(path: str | Path, out: str | Path) -> Path:
    """`loopformer export RUN --out DIR`: the full weights (and average) of a sharded checkpoint, rebuilt from its
    `sharded/` folder alone in one process, as a checkpoint folder of model.safetensors (ema.safetensors) and the
    checkpoint's config.json, which `loopformer.load`, `eval` and `generate` read. DIR must be new, empty or an
    earlier export (its config.json records `run.exported_from`); nothing else is replaced."""
    from loopformer.model.io import check_checkpoint_out, read_config, resolve_checkpoint, save_checkpoint
    from loopformer.model.looped import LoopedTransformer

    ckpt = resolve_checkpoint(path)
    if not (ckpt / SHARDED).is_dir():
        raise UserError(f"{ckpt} holds no sharded checkpoint ({SHARDED}/; written by train.system.parallel=fsdp)")
    check_checkpoint_out(out, "export", "exported_from", "choose a new folder for the exported checkpoint")
    cfg, extra = read_config(ckpt, weights=False)
    tensors = read_sharded(ckpt / SHARDED)
    models = {}
    for group in ("model", "ema"):
        if group not in tensors:
            continue
        m = LoopedTransformer(cfg)
        state = {**tensors["model"], **tensors[group]}     # the average holds parameters only: buffers as saved
        missing, unexpected = m.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(f"{ckpt / SHARDED} does not match its config.json: missing {sorted(missing)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]}")
        models[group] = m
    if "model" not in models:
        raise UserError(f"{ckpt / SHARDED} holds no model weights")
    run = dict(extra.get("run") or {})
    run["exported_from"] = str(ckpt.resolve())
    return save_checkpoint(out, models["model"], run=run, task=extra.get("task"), ema=models.get("ema"))


__all__ = ["SHARDED", "export_sharded", "full", "full_state", "gather_tensors", "gradient_sync", "is_sharded",
           "load_sharded", "local", "read_sharded", "reshard", "save_sharded", "shard_model"]
