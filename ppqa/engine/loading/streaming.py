"""Weights read from their files straight to a GPU: byte runs through a ring of pinned buffers.

A tensor in a safetensors shard or a GGUF file is a run of bytes at a known offset
(`TensorRun`, from the loader's reading of the header: hf.py, gguf.py). `stream_runs` cuts the
runs into chunks and reads each chunk with a plain positioned read (`os.preadv`, which releases
the GIL) into one of a few pinned host buffers, on a pool of threads, while the main thread
copies each filled buffer to the device asynchronously.
So the page cache's (or the disk's) reads, the host's memory copies and the PCIe transfers
overlap, where reading each tensor through a memory map and `.to(device)` does them one after
the other from pageable memory (benchmarks/RESULTS.md, "Loading weights").

Each tensor comes out on the device in its file's dtype once its last chunk's copy is queued on
the current stream; what the caller does with it is queued behind those copies. A buffer is
refilled only after the copy out of it has finished (an event per buffer). Where CUDA will not
page-lock the ring (a container's limit on locked memory), the load warns and copies from the
same buffers unlocked: slower (each copy stages through the driver), the same bytes.

Data flow: loader (runs from a header) -> `stream_runs` -> (name, device tensor) -> the loader
(a GGUF's blocks unpack there) -> the model's parameters.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_BYTES = 32 << 20
BUFFERS = 8  # pinned buffers in the ring: BUFFERS - 1 reads in flight beside one copy


@dataclass(frozen=True)
class TensorRun:
    """One tensor's bytes in a file: `nbytes` from `offset`, to be viewed as dtype x shape."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Chunk:
    run: int  # index of its run
    start: int  # its first byte within the run
    nbytes: int


def _chunks(runs: Sequence[TensorRun], chunk_bytes: int) -> list[_Chunk]:
    out = []
    for i, run in enumerate(runs):
        for start in range(0, run.nbytes, chunk_bytes):
            out.append(_Chunk(i, start, min(chunk_bytes, run.nbytes - start)))
    return out


def _read(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset` of the file (positioned reads until full)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def stream_runs(runs: Sequence[TensorRun], device: torch.device, *,
                chunk_bytes: int = CHUNK_BYTES, buffers: int = BUFFERS, threads: int = 4,
                host: torch.Tensor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device` in its run's dtype and shape) for each run, in order. For a
    CUDA device `chunk_bytes` x `buffers` of host memory is page-locked while it runs (where
    that fails, `_pin` warns and the copies come from the same memory unlocked); on the CPU the
    same pipeline copies synchronously (the loaders read CPU weights memory-mapped instead:
    this path is for tests). `host`: the ring's memory, uint8 of at least that many bytes
    (default: allocated here; tests pass memory they registered with CUDA themselves)."""
    chunks = _chunks(runs, chunk_bytes)
    width = min(buffers, max(len(chunks), 1))
    if host is None:
        host = torch.empty(width * chunk_bytes, dtype=torch.uint8)
    host = host[:width * chunk_bytes]
    cuda = device.type == "cuda"
    pinned = cuda and _pin(host)
    ring = host.view(width, chunk_bytes)
    views = [memoryview(ring[i].numpy()) for i in range(width)]
    copied = [torch.cuda.Event() if cuda else _Done() for _ in range(width)]
    fds = {path: os.open(path, os.O_RDONLY) for path in {r.path for r in runs}}
    reads: deque = deque()
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ppqa-weights") as pool:
            def submit(c: int) -> None:
                slot = c % width
                copied[slot].synchronize()  # the copy out of this buffer is done
                chunk = chunks[c]
                run = runs[chunk.run]
                reads.append(pool.submit(_read, fds[run.path], views[slot][:chunk.nbytes],
                                         run.offset + chunk.start))

            for c in range(min(width - 1, len(chunks))):
                submit(c)
            done = 0  # runs yielded
            target = None
            for c, chunk in enumerate(chunks):
                while done < chunk.run:  # runs of no bytes have no chunk
                    yield _empty(runs[done], device)
                    done += 1
                reads.popleft().result()
                run = runs[chunk.run]
                if chunk.start == 0:
                    target = torch.empty(run.nbytes, dtype=torch.uint8, device=device)
                slot = c % width
                target[chunk.start:chunk.start + chunk.nbytes].copy_(ring[slot][:chunk.nbytes],
                                                                    non_blocking=True)
                copied[slot].record()
                if c + width - 1 < len(chunks):
                    submit(c + width - 1)
                if chunk.start + chunk.nbytes == run.nbytes:
                    yield run.name, target.view(run.dtype).view(run.shape)
                    done += 1
            while done < len(runs):
                yield _empty(runs[done], device)
                done += 1
    finally:
        for event in copied:
            event.synchronize()  # no copy still reads the buffers
        if pinned:
            _unregister(host)
        for fd in fds.values():
            os.close(fd)


class _Done:
    """A CPU copy's event: the copy is over when copy_ returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _empty(run: TensorRun, device: torch.device) -> tuple[str, torch.Tensor]:
    return run.name, torch.empty(run.shape, dtype=run.dtype, device=device)


def _pin(host: torch.Tensor) -> bool:
    """Page-locks `host` for the loader's lifetime (not through torch's pinned-memory cache,
    which would keep it for the process's); True if it did. Where CUDA refuses (a container's
    limit on locked memory, memory registered already) it warns and clears the error, which the
    runtime would otherwise keep for torch's next kernel launch to raise as its own."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
    if not int(err):
        return True
    try:
        _clear_last_error()
    except OSError as e:  # no runtime to clear the error in: falling back would meet it later
        raise RuntimeError(f"cudaHostRegister of {host.numel()} bytes failed (CUDA error "
                           f"{int(err)}) and the error could not be cleared: {e}") from e
    warnings.warn(f"ppqa: cannot page-lock {host.numel() / 1e6:.1f} MB of host memory for loading "
                  f"weights (cudaHostRegister: CUDA error {int(err)}, "
                  f"{cudart.cudaGetErrorString(err)}); copying them from pageable memory, "
                  "which is slower", RuntimeWarning, stacklevel=3)
    return False


def _clear_last_error() -> None:
    """cudaGetLastError in the CUDA runtime that torch loaded (`torch.cuda.cudart()` binds no
    such call; the library is already in the process, so this opens the same instance)."""
    runtime = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    runtime.cudaGetLastError()


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
