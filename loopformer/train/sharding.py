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
as any other; `export_sharded` rebuilds those files from `sharded/` alone, without processes. Rank 0 also lists the
folder's files, tensors and identity in `sharded/manifest.json`; both readers verify the folder against it and never
unpickle anything but DCP's own metadata classes (`loopformer.train.shard_manifest`).

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
from loopformer.train.shard_manifest import read_manifest, safe_planner, safe_reader, verify, write_manifest

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
                 ema: dict | None = None, identity: dict | None = None) -> None:
    """Write the sharded weights, optimiser state (and weight average `ema`: {name: sharded tensor}) of every
    process into `folder` (every process calls it with the same folder). Rank 0 passes `identity` ({"id", "step"},
    also recorded in the checkpoint's training state) and writes the folder's manifest once every shard is written
    (`loopformer.train.shard_manifest`)."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.save(_state(model, optimizer, ema), checkpoint_id=str(folder))
    if identity is not None:
        write_manifest(folder, meta, identity)


def _agree(error: str | None) -> None:
    """Raise the first process's error on every process (a process that stops alone would leave the others
    waiting in a collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise UserError(error)


def _nonfinite(groups: dict[str, dict[str, Any]]) -> str | None:
    """The first tensor (this process's shard of it) holding a NaN or an infinity, as "group.name", or None."""
    for group, tensors in groups.items():
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(local(t)).all()):
                return f"{group}.{name}"
    return None


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ema: dict | None = None, expect: dict | None = None) -> None:
    """Read `save_sharded`'s folder into a sharded model, its optimiser (and `ema`, in place) on any number of
    processes. The folder is verified first (its manifest's files, checksums and tensors, the identity `expect`
    its training state records; its metadata read without unpickling anything but DCP's own classes); a folder that
    is missing, incomplete, damaged, mixed, crafted or of another model, or weights holding NaN or infinities, is a
    one-line UserError on every process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    error, meta = None, None
    try:
        if not (folder / ".metadata").is_file():
            raise UserError(f"cannot resume: {folder} holds no sharded checkpoint (its .metadata is missing)")
        # every process checks the manifest and reads the metadata; rank 0 hashes the shards for all
        meta = verify(folder, expect, checksums=not dist.is_initialized() or dist.get_rank() == 0)
    except UserError as exc:
        error = f"cannot resume: {exc}"
    _agree(error)
    state = _state(model, optimizer, ema)
    try:
        dcp.load(state, storage_reader=safe_reader(folder, meta), planner=safe_planner())
    except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - any failure to read the folder
        raise UserError(f"cannot resume from {folder}: {_first_line(exc)}") from None
    bad = _nonfinite({"model": state["model"], **({"ema": ema} if ema is not None else {})})
    _agree(None if bad is None else f"cannot resume from {folder}: {bad} holds NaN or infinite values (the run "
                                    f"diverged or the shard was damaged); refusing to train on from it")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _first_line(exc: BaseException) -> str:
    """The informative line of an exception: DCP reports each process's error as a traceback, whose last line is
    the error itself (a missing shard: "FileNotFoundError: ... __1_0.distcp")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def checkpoint_identity(ckpt: Path) -> dict | None:
    """The identity ({"id", "step"}) of the sharded folder that the training state of the checkpoint folder `ckpt`
    records (None: it records none)."""
    from loopformer.model.io import load_training_state
    state = load_training_state(ckpt)
    if state is None:
        raise UserError(f"{ckpt} holds no training state, which names its sharded checkpoint")
    if not state.get("sharded"):
        raise UserError(f"{ckpt} was not written by a sharded run (its training state records no sharded "
                        f"checkpoint); its weights are {ckpt / 'model.safetensors'}")
    return state.get("shards")


def read_sharded(folder: Path, expect: dict | None = None,
                 shapes: dict[str, dict[str, list[int]]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of `save_sharded`'s folder, whole, in one process without a process group:
    {"model": {...}, "ema": {...}} (the optimiser state is left out). The folder is verified first against
    `expect` (default: the identity the training state beside it records); with `shapes` ({"model": {name: shape},
    "ema": {...}}) its tensors must be exactly those, checked before anything is allocated. Weights holding NaN or
    infinities are refused. Errors are one-line UserErrors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not (folder / ".metadata").is_file():
        raise UserError(f"{folder} holds no sharded checkpoint (its .metadata is missing)")
    meta = verify(folder, checkpoint_identity(folder.parent) if expect is None else expect)
    stored: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, item in meta.state_dict_metadata.items():
        group, _, name = key.partition(".")
        if group in ("model", "ema") and isinstance(item, TensorStorageMetadata):
            stored.setdefault(group, {})[name] = item
    if shapes is not None:
        for group, want in shapes.items():
            have = {n: list(v.size) for n, v in stored.get(group, {}).items()}
            if group == "ema" and not have:
                continue
            diff = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
            if diff:
                n = diff[0]
                raise UserError(f"{folder} does not match its config.json: {group} {n} has shape {have.get(n)} in "
                                f"the shards, the config asks for {want.get(n)}")
        for group, items in stored.items():
            for name, item in items.items():
                if item.properties.dtype != torch.float32:
                    raise UserError(f"{folder}: {group}.{name} is stored as {item.properties.dtype}, not float32")
    want_t = {g: {n: torch.empty(v.size, dtype=v.properties.dtype) for n, v in items.items()}
              for g, items in stored.items()}
    try:
        dcp.load(want_t, storage_reader=safe_reader(folder, meta), planner=safe_planner(), no_dist=True)
    except UserError:
        raise
    except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - a missing or damaged shard, a foreign folder
        raise UserError(f"cannot read the sharded checkpoint {folder}: {_first_line(exc)}") from None
    bad = _nonfinite(want_t)
    if bad is not None:
        raise UserError(f"{folder}: {bad} holds NaN or infinite values (the run diverged or the shard was damaged); "
                        f"refusing to export it")
    return want_t


def export_sharded(path: str | Path, out: str | Path) -> Path:
    """`loopformer export RUN --out DIR`: the full weights (and average) of a sharded checkpoint, rebuilt from its
    `sharded/` folder alone in one process, as a checkpoint folder of model.safetensors (ema.safetensors) and the
    checkpoint's config.json, which `loopformer.load`, `eval` and `generate` read. DIR must be new, empty or an
    earlier export (its config.json records `run.exported_from`); nothing else is replaced."""
    from loopformer.model.io import check_checkpoint_out, read_config, resolve_checkpoint, save_checkpoint
    from loopformer.model.looped import LoopedTransformer
    from loopformer.model.memory import check_fits, param_count

    ckpt = resolve_checkpoint(path)
    if not (ckpt / SHARDED).is_dir():
        raise UserError(f"{ckpt} holds no sharded checkpoint ({SHARDED}/; written by train.system.parallel=fsdp)")
    check_checkpoint_out(out, "export", "exported_from", "choose a new folder for the exported checkpoint")
    cfg, extra = read_config(ckpt, weights=False)
    expect = checkpoint_identity(ckpt)
    averaged = any(k.startswith("ema.") for k in read_manifest(ckpt / SHARDED)["tensors"])
    # config.json's sizes before anything is built: the memory of the model (and its average), then its shapes
    check_fits({"parameters": 4 * param_count(cfg) * (2 if averaged else 1)}, "cpu", f"the model of {ckpt}",
               skip=None)
    with torch.device("meta"):
        meta_model = LoopedTransformer(cfg)
    model_shapes = {k: list(v.shape) for k, v in meta_model.state_dict().items()}
    param_shapes = {k: list(v.shape) for k, v in meta_model.named_parameters()}
    tensors = read_sharded(ckpt / SHARDED, expect, {"model": model_shapes, "ema": param_shapes})
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


__all__ = ["SHARDED", "checkpoint_identity", "export_sharded", "full", "full_state", "gather_tensors", "gradient_sync",
           "is_sharded", "load_sharded", "local", "read_sharded", "reshard", "save_sharded", "shard_model"]
