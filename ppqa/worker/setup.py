"""Checks `ppqa run` makes before it claims any job: the device exists and works, the model loads.

`resolve_device(gpu, device)` turns `--gpu N` / `--device D` into a torch device string (the GPU
when there is one, else the CPU) and `load_engine(model, device)` builds the Engine once per
worker. Each failure raises `SetupError` with one line for the terminal, so that a wrong model
name or a missing GPU is reported before a lease is taken. torch is imported here, never at
the CLI's import time.
"""

from __future__ import annotations

import os
import socket
import uuid


class SetupError(RuntimeError):
    """The worker cannot start: a bad device or a model that does not load (one line)."""


def default_worker_id() -> str:
    """host:pid plus a short random tag, so that a restarted worker with a reused pid (a
    container) never mistakes its predecessor's leases for its own."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def resolve_device(gpu: int | None = None, device: str | None = None) -> str:
    """'cpu' or 'cuda:N' for `--gpu N` / `--device D` (default: the GPU when there is one),
    checked to exist and to run a tiny operation."""
    from ppqa.engine.devices import resolve_device as engine_device

    if gpu is not None and device is not None:
        raise SetupError("give --gpu N or --device, not both")
    if gpu is not None:
        if gpu < 0:
            raise SetupError(f"--gpu must be a GPU index >= 0, got {gpu}")
        device = f"cuda:{gpu}"
    try:
        return str(engine_device(device or "auto", probe=True))
    except ValueError as exc:
        raise SetupError(str(exc)) from None


def load_engine(model: str, device: str, **config_fields):
    """The Engine for `model` on `device` (EngineConfig fields such as mem_fraction may be given),
    or SetupError naming the model and the reason."""
    if not model or not model.strip():
        raise SetupError("--model must be a model name, a Hugging Face folder or a .gguf file")
    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine

    try:
        return Engine(model, device=device, config=EngineConfig(**config_fields))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for the terminal, whatever went wrong
        raise SetupError(f"cannot load model {model!r} on {device}: {_first_line(exc)}") from None


def process_age() -> float | None:
    """Seconds since this process started (Linux; None elsewhere), to report start-up."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
