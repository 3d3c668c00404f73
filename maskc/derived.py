"""Values derived from tensors (a Mask built from position ids, a batch mask cropped by its
padding), kept on the tensor for the next call that passes it: every layer of a step and the
backward pass the same tensors, and reading a GPU tensor on the host waits for the GPU.

A kept value is reused only while its tensors still hold what it was derived from. A CPU tensor
is compared with a copy of its content (a write through a numpy view or `.data` bypasses torch's
version counter; comparing costs about 40 us for 128k int64 positions). A GPU tensor cannot be
read without waiting for the GPU, so there it must be the same tensor, at the same address, with
the same version count: a write that bypasses the counter (through `.data`, DLPack or another
library's view of its memory) is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")
_ATTRIBUTE = "_maskc_derived"


def derived(tensors: Sequence[torch.Tensor], key: Hashable, build: Callable[[], T]) -> T:
    """`build()`, kept on `tensors[0]` under `key` and reused while every tensor of `tensors`
    holds what it held when the value was built."""
    kept = getattr(tensors[0], _ATTRIBUTE, None)
    if kept is None:
        kept = {}
        setattr(tensors[0], _ATTRIBUTE, kept)
    entry = kept.get(key)
    if entry is not None and all(stamp.holds(t) for stamp, t in zip(entry[0], tensors)):
        return entry[1]
    value = build()
    kept[key] = (tuple(map(_stamp, tensors)), value)
    return value


class _Content:
    """A CPU tensor's dtype, shape and a copy of its values."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype, self.shape, self.values = tensor.dtype, tensor.shape, _host_values(tensor).copy()

    def holds(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type == "cpu" and (tensor.dtype, tensor.shape) == (self.dtype, self.shape)
                and np.array_equal(self.values, _host_values(tensor)))  # fmt: skip


class _Version:
    """A GPU tensor (by reference) and where it is and how often torch has written it; an inference
    tensor counts no writes, so its stamp never holds."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.state = weakref.ref(tensor), _state(tensor)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.tensor() is tensor and self.state is not None and _state(tensor) == self.state


def _state(tensor: torch.Tensor) -> tuple | None:
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor
        return None
    return version, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


def _stamp(tensor: torch.Tensor) -> _Content | _Version:
    return _Content(tensor) if tensor.device.type == "cpu" else _Version(tensor)


def _host_values(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy, without a copy where it is contiguous (16-bit floats as
    their bits: numpy has no bfloat16)."""
    values = tensor.detach().contiguous()
    return (values.view(torch.int16) if values.dtype in (torch.bfloat16, torch.float16) else values).numpy()
