"""A host copy's flat buffers on disk, as a safetensors file (the disk tier below host memory, issue 18).

Written and read here rather than through the safetensors library: its writer serialises every tensor to bytes
first (a second host copy of a model, at the moment host memory is short), and its reader returns new, unpinned
tensors that a restore would copy once more. Here a buffer goes to disk from its own memory and comes back
straight into a pinned buffer. The file is a plain safetensors file (the library reads it; tests check that).

The page cache must not hold a second copy of what host memory is budgeted for, so a file's pages are dropped
from it once written and once read (``posix_fadvise(DONTNEED)``): a load then costs a real disk read.
"""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import torch

#: safetensors' names for the dtypes a model's tensors have
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
#: most bytes one read or write system call moves on Linux
IO_CHUNK = 1 << 30
#: a header this module writes is a few hundred bytes (one entry per dtype)
MAX_HEADER = 1 << 20


def write_weights(path: Path, buffers: dict[torch.dtype, torch.Tensor]) -> None:
    """Write one flat buffer per dtype to ``path`` (atomically: a file named there is always whole)."""
    header: dict[str, object] = {}
    offset = 0
    for dtype, buffer in buffers.items():
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} has no safetensors name")
        header[str(dtype)] = {"dtype": DTYPE_NAMES[dtype], "shape": [buffer.numel()],
                              "data_offsets": [offset, offset + buffer.nbytes]}
        offset += buffer.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format keeps the data 8-byte aligned
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb", buffering=0) as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for buffer in buffers.values():
            data = memoryview(_bytes_of(buffer))
            file.writelines(data[start:start + IO_CHUNK] for start in range(0, len(data), IO_CHUNK))
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    partial.replace(path)


def read_weights(path: Path, sizes: dict[torch.dtype, int], pin: bool) -> dict[torch.dtype, torch.Tensor]:
    """The buffers ``write_weights`` wrote, read into new (pinned when ``pin``) host buffers of ``sizes``
    elements; a file that does not hold exactly those buffers is refused (ValueError)."""
    with open(path, "rb", buffering=0) as file:
        (length,) = struct.unpack("<Q", _read_exactly(file, 8))
        if length > MAX_HEADER:
            raise ValueError(f"{path}: a header of {length} bytes is not one this module wrote")
        header = json.loads(_read_exactly(file, length))
        start = 8 + length
        buffers = {}
        for dtype, numel in sizes.items():
            entry = header.get(str(dtype))
            if entry is None or entry["shape"] != [numel] or entry["dtype"] != DTYPE_NAMES[dtype]:
                raise ValueError(f"{path} does not hold {numel} elements of {dtype} (found {entry})")
            buffer = torch.empty(numel, dtype=dtype, pin_memory=pin)
            begin, end = entry["data_offsets"]
            if end - begin != buffer.nbytes:
                raise ValueError(f"{path}: {dtype} takes {end - begin} bytes, expected {buffer.nbytes}")
            file.seek(start + begin)
            target = memoryview(_bytes_of(buffer))
            done = 0
            while done < len(target):
                read = file.readinto(target[done:done + IO_CHUNK])
                if not read:
                    raise ValueError(f"{path} ends {len(target) - done} bytes early")
                done += read
            buffers[dtype] = buffer
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return buffers


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """The buffer's memory as bytes, without a copy (any dtype: numpy has no bfloat16, so through uint8)."""
    array = buffer.view(torch.uint8).numpy()
    return memoryview(array.data)


def _read_exactly(file: io.FileIO, count: int) -> bytes:
    data = file.read(count)
    if data is None or len(data) != count:
        raise ValueError("the file ends inside its header")
    return bytes(data)
