"""The device resolver, defined once: a device name ("auto", "cpu", "cuda", "cuda:N") to a
checked `torch.device`. The engine calls it for `EngineConfig.device`; `ppqa run` calls it (through
the worker's setup) before it claims any job, so a missing GPU is one line, not a traceback.
"""

from __future__ import annotations

import torch


def resolve_device(name: str, *, probe: bool = False) -> torch.device:
    """The torch device for `name`; ValueError with one line when it does not exist. With
    `probe`, a GPU must also run a tiny operation (it can exist yet be unusable: busy in
    exclusive mode, a broken driver)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise ValueError(f"cannot use {name}: no CUDA GPU is available here (use cpu)")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"there is no GPU {index}: this machine has {count} "
                         f"(indices 0 to {count - 1})")
    device = torch.device("cuda", index)
    if probe:
        try:
            torch.ones(1, device=device).add_(1)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure means the same thing here
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"GPU {index} is not usable: {first}") from None
    return device
