"""The device a command runs on and what can be compiled there: the device choices (auto, cpu, cuda, cuda:N, mps),
the pick for a process (under torchrun: its local rank's GPU), and whether torch.compile's code generation is
available (Triton on CUDA, a C++ compiler on a CPU).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from loopformer.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps")   # device choices (also `cuda:N` where a device index is accepted)


def check_device(name: str) -> str:
    """`name` if it names a device kind loopformer knows (auto, cpu, cuda, cuda:N, mps), else a UserError."""
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device must be one of auto, cpu, cuda, cuda:N, mps (got {name!r})")
    return name


def pick_device(choice: str | None = "auto", local_rank: int = 0) -> torch.device:
    """'auto' (or None) → CUDA if available, else Apple MPS, else CPU; an explicit choice must be available.
    Plain 'cuda' is the process's GPU under torchrun (`local_rank`), 'cuda:N' a given one."""
    choice = check_device(choice or "auto")
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else ("mps" if has_mps else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"device {choice} was asked for but no CUDA device is available")
        if ":" in choice:
            return torch.device(choice)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if choice == "mps":
        if not has_mps:
            raise UserError("device mps was asked for but Apple MPS is not available")
        return torch.device("mps")
    return torch.device("cpu")


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile's code generation is available on `device`: Triton on a CUDA device, a C++ compiler
    on a CPU."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return device.type == "cpu" and any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++",
                                                                      "clang++"))


__all__ = ["DEVICES", "check_device", "pick_device", "can_compile"]
