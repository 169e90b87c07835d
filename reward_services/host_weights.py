"""A model's weights packed for fast restores: one flat host buffer per dtype, and its images on devices.

One buffer per dtype means a restore is a handful of large copies instead of one per tensor, which is what lets
it run near the host-to-device bandwidth. On a CUDA build the host buffers are pinned (page-locked), so those
copies are true DMA transfers that need no staging; a CPU-only build cannot pin, and the buffers are plain memory.
Each tensor starts at a 256-byte boundary so that views into a device buffer are as aligned as separately
allocated tensors (vectorized kernels and cuBLAS expect it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from reward_services.weights_file import read_weights, write_weights

ALIGN_BYTES = 256


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter or buffer lives in the flat buffer of its dtype (offset and size in elements)."""

    name: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]

    def view(self, buffers: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
        """This tensor inside ``buffers`` (flat buffers laid out like the ones it was packed into)."""
        return buffers[self.dtype][self.offset:self.offset + math.prod(self.shape)].view(self.shape)


@dataclass(eq=False)
class DeviceWeights:
    """A host copy's image on one device: a buffer per dtype, and every tensor name viewing into them."""

    device: torch.device
    buffers: dict[torch.dtype, torch.Tensor]
    views: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())


class HostWeights:
    """A module's parameters and buffers in one host buffer per dtype, plus the table to find each tensor.

    Tied tensors (one tensor reachable under several names) are stored once: ``slots`` holds each distinct
    tensor, ``aliases`` maps every other name to the slot name it shares. With a disk tier the buffers can be
    written to a file (``save``), dropped (``release``) and read back (``load``); the layout stays.
    """

    def __init__(self, buffers: dict[torch.dtype, torch.Tensor], slots: tuple[TensorSlot, ...],
                 aliases: dict[str, str], pinned: bool) -> None:
        self.buffers = buffers
        self.slots = slots
        self.aliases = aliases
        self.pinned = pinned
        #: elements per dtype buffer, kept while the buffers are on disk
        self.sizes = {dtype: buffer.numel() for dtype, buffer in buffers.items()}
        self.in_memory = True

    @classmethod
    def pack(cls, module: torch.nn.Module, pin: bool) -> HostWeights:
        """Copy ``module``'s tensors into new flat buffers (pinned when ``pin``); the module is left untouched."""
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        first_name: dict[int, str] = {}
        aliases: dict[str, str] = {}
        sources: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named:
            if id(tensor) in first_name:
                aliases[name] = first_name[id(tensor)]
            else:
                first_name[id(tensor)] = name
                sources.append((name, tensor))
        sizes: dict[torch.dtype, int] = {}
        slots = []
        for name, tensor in sources:
            align = max(1, ALIGN_BYTES // tensor.element_size())
            offset = -(-sizes.get(tensor.dtype, 0) // align) * align
            slots.append(TensorSlot(name, tensor.dtype, offset, tuple(tensor.shape)))
            sizes[tensor.dtype] = offset + tensor.numel()
        buffers = {dtype: torch.empty(size, dtype=dtype, pin_memory=pin) for dtype, size in sizes.items()}
        with torch.no_grad():
            for slot, (_, tensor) in zip(slots, sources):
                slot.view(buffers).copy_(tensor)
        return cls(buffers, tuple(slots), aliases, pin)

    @property
    def nbytes(self) -> int:
        """Host bytes held, alignment padding included (0 once released)."""
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def views(self, buffers: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor name as a view into ``buffers`` (this host copy's, or a device image's)."""
        views = {slot.name: slot.view(buffers) for slot in self.slots}
        views.update({alias: views[name] for alias, name in self.aliases.items()})
        return views

    def to_devices(self, devices: Sequence[torch.device]) -> list[DeviceWeights]:
        """Copy onto each device into newly allocated buffers; returns once every copy has landed.

        All copies are issued first (asynchronous from pinned memory), so copies to different GPUs overlap.
        """
        if not self.in_memory:
            raise RuntimeError("the host copy is on disk: load it first")
        images = []
        for device in devices:
            buffers = {}
            for dtype, host in self.buffers.items():
                target = torch.empty(host.numel(), dtype=dtype, device=device)
                target.copy_(host, non_blocking=True)
                buffers[dtype] = target
            images.append(DeviceWeights(device, buffers, self.views(buffers)))
        for device in dict.fromkeys(device for device in devices if device.type == "cuda"):
            torch.cuda.synchronize(device)
        return images

    def save(self, path: Path) -> None:
        """Write the buffers to ``path`` (a safetensors file) for ``load`` after ``release``."""
        write_weights(path, self.buffers)

    def load(self, path: Path) -> None:
        """Read the buffers back from what ``save`` wrote."""
        if not self.in_memory:
            self.buffers = read_weights(path, self.sizes, self.pinned)
            self.in_memory = True

    def release(self) -> None:
        """Drop the host buffers; cached pinned blocks go back to the system too."""
        self.buffers = {}
        self.in_memory = False
        if self.pinned:
            torch._C._host_emptyCache()
