"""Checks `ppqa run` makes before it claims any job: the device exists and works, the model loads.

`resolve_device(gpu, device)` turns `--gpu N` / `--device D` into a torch device string (the GPU
when there is one, else the CPU) and `load_engine(model, device)` builds the Engine once per
worker. `device_groups` turns `--gpus 0,1` / `--gpus all` and `--tensor-parallel N` into the
devices of each worker (one worker per group of N), and `load_parallel_engine` builds a
tensor-parallel engine over one group (engine/parallel/launch.py). Each failure raises
`SetupError` with one line for the terminal, so that a wrong model name or a missing GPU is
reported before a lease is taken. torch is imported here, never at the CLI's import time.
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


def check_device_flags(gpus: str | None, devices: str | None, tensor_parallel: int = 1, *,
                       gpu: int | None = None, device: str | None = None) -> None:
    """SetupError for device options that contradict each other (no torch: `ppqa run` checks
    them before it looks for work)."""
    if gpus is not None and devices is not None:
        raise SetupError("give --gpus or --devices, not both")
    if (gpus is not None or devices is not None) and (gpu is not None or device is not None):
        raise SetupError("give --gpus (a worker per GPU) or --gpu/--device (one worker), not both")
    if tensor_parallel < 1:
        raise SetupError(f"--tensor-parallel must be at least 1, got {tensor_parallel}")
    if gpus is None and devices is None and tensor_parallel > 1 and (gpu is not None
                                                                     or device is not None):
        raise SetupError(f"--tensor-parallel {tensor_parallel} splits the model over "
                         f"{tensor_parallel} GPUs: name them with --gpus, e.g. --gpus "
                         f"{','.join(map(str, range(tensor_parallel)))}")


def device_groups(gpus: str | None, devices: str | None, tensor_parallel: int = 1, *,
                  gpu: int | None = None, device: str | None = None) -> list[list[str]] | None:
    """The devices of each worker for `--gpus LIST|all` (or the hidden `--devices`, torch
    device names, for tests) and `--tensor-parallel N`: consecutive groups of N devices; None
    when neither is given (one worker on `--gpu` / `--device`)."""
    check_device_flags(gpus, devices, tensor_parallel, gpu=gpu, device=device)
    if gpus is None and devices is None:
        if tensor_parallel == 1:
            return None
        names = [f"cuda:{i}" for i in range(tensor_parallel)]
    elif devices is not None:
        names = [d.strip() for d in devices.split(",")]
    else:
        names = [f"cuda:{i}" for i in _gpu_indices(gpus)]
    # The hidden --devices may repeat "cpu" (tests run two CPU workers); a GPU serves one.
    repeated = gpus is not None and len(set(names)) != len(names)
    if not names or any(not n for n in names) or repeated:
        raise SetupError(f"give each device once, separated by commas, got {gpus or devices!r}")
    if len(names) % tensor_parallel:
        raise SetupError(f"--tensor-parallel {tensor_parallel} needs a multiple of "
                         f"{tensor_parallel} GPUs (one worker per {tensor_parallel}), got "
                         f"{len(names)}")
    return [names[i:i + tensor_parallel] for i in range(0, len(names), tensor_parallel)]


def _gpu_indices(gpus: str) -> list[int]:
    if gpus.strip().lower() == "all":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SetupError("--gpus all: no CUDA device is visible on this machine")
        return list(range(count))
    try:
        indices = [int(part) for part in gpus.split(",")]
    except ValueError:
        raise SetupError(f"--gpus takes GPU indices separated by commas (e.g. --gpus 0,1) or "
                         f"'all', got {gpus!r}") from None
    if any(i < 0 for i in indices):
        raise SetupError(f"--gpus indices must be >= 0, got {gpus!r}")
    return indices


def load_engine(model: str, device: str, **config_fields):
    """The Engine for `model` on `device` (EngineConfig fields such as mem_fraction may be given),
    or SetupError naming the model and the reason."""
    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine

    return _loading(model, device, lambda: Engine(model, device=device,
                                                  config=EngineConfig(**config_fields)))


def load_parallel_engine(model: str, devices: list[str], **config_fields):
    """(rank 0's Engine, the RankGroup to close at the end) for `model` split over `devices`,
    one process per device; SetupError as `load_engine`."""
    from ppqa.engine.parallel.launch import start_engine

    from ppqa.engine.devices import resolve_device as engine_device

    try:  # each exists (no context on the others: their own processes probe them)
        devices = [str(engine_device(d, probe=i == 0)) for i, d in enumerate(devices)]
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    return _loading(model, "+".join(devices),
                    lambda: start_engine(model, devices, **config_fields))


def _loading(model: str, where: str, build):
    if not model or not model.strip():
        raise SetupError("--model must be a model name, a Hugging Face folder or a .gguf file")
    try:
        return build()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for the terminal, whatever went wrong
        raise SetupError(f"cannot load model {model!r} on {where}: {_first_line(exc)}") from None


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
