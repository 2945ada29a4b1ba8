"""Starting the ranks of one tensor-parallel engine from a single process.

`start_engine(model, devices, **config)` is what `ppqa run --tensor-parallel N` calls: it
refuses a model whose heads N does not divide (from its config, before anything starts), starts
N-1 follower processes (multiprocessing's spawn: a fresh interpreter each), makes the calling
process rank 0 on `devices[0]`, joins all of them in one torch.distributed group over
127.0.0.1 (NCCL on GPUs, gloo on the CPU) and builds the engine on every rank. It returns rank
0's `Engine`, whose `shutdown()` ends the followers' `follow()`; `RankGroup.close()` does that and
waits for them.

The followers ignore SIGINT and SIGTERM (a Ctrl-C reaches the whole process group, but only
rank 0 decides when to stop: it finishes its stop handling, then shuts the followers down), and
die with rank 0 (Linux's parent-death signal). A follower that dies makes rank 0's next
collective fail or hang; a watcher in rank 0 then ends the process at once (exit 1), and its
jobs' leases expire as after any crash. NVLink multicast stays off (the device rules):
NCCL_NVLS_ENABLE=0 and its siblings are set before any rank starts.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from datetime import timedelta

# Long: a follower waits in a broadcast for as long as rank 0 has no work (`run --follow`).
GROUP_TIMEOUT = timedelta(days=7)
# A follower that failed its setup: rank 0 usually fails the same way; its own error (one line)
# comes first unless it is stuck in a collective (NCCL waits for the dead rank).
SETUP_GRACE_S = 60.0
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keep_multicast_off() -> None:
    """NVLink multicast off in NCCL, PyTorch and NVSHMEM unless the environment says otherwise:
    on a shared host it can put the GPUs out of service."""
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)


def join_group(rank: int, world: int, port: int, device: str,
               timeout: timedelta = GROUP_TIMEOUT) -> None:
    """Join rank `rank` of `world` on 127.0.0.1:`port`: NCCL on a CUDA device (made current),
    gloo on the CPU."""
    import torch
    import torch.distributed as dist

    keep_multicast_off()
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)


def leave_group() -> None:
    """Every rank together (a barrier), then the group is destroyed: a rank that tore its
    group down while another still used it could abort at exit."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) exits, however it exits."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def follower_main(rank: int, world: int, port: int, model: str, device: str,
                  config_fields: dict) -> None:
    """A follower process: join the group, build this rank's engine, follow rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine

    join_group(rank, world, port, device)
    try:
        engine = Engine(model, device=device,
                        config=EngineConfig(tensor_parallel=world, **config_fields))
    except Exception as exc:  # noqa: BLE001 - rank 0 reports the same failure in one line
        print(f"tensor-parallel rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
    engine.follow()
    leave_group()


class RankGroup:
    """Rank 0's view of its followers."""

    def __init__(self, processes: list) -> None:
        self.processes = processes
        self.engine = None
        self._closing = False
        threading.Thread(target=self._watch, daemon=True, name="ppqa-ranks").start()

    def _watch(self) -> None:
        import time
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.processes])
        if self.engine is None:  # during setup rank 0 usually fails the same way: let it say so
            time.sleep(SETUP_GRACE_S)
        if not self._closing:
            dead = next(p for p in self.processes if not p.is_alive())
            print(f"error: a tensor-parallel rank exited (code {dead.exitcode}); stopping this "
                  "worker, whose leases will expire", file=sys.stderr, flush=True)
            os._exit(1 if self.engine is not None else 2)

    def close(self, timeout: float = 30.0) -> None:
        """Release the followers and wait for them."""
        self._closing = True
        if self.engine is not None:
            self.engine.shutdown()
            leave_group()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()


def start_engine(model: str, devices: list[str], **config_fields):
    """(rank 0's Engine, its RankGroup) for `model` split over `devices`, one rank each."""
    import multiprocessing

    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine

    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.parallel.tensor_parallel import check_divisible

    # A model that cannot be split is refused before any process starts (its weights are
    # lazy: only the config is read here).
    check_divisible(load_model(model).config, len(devices))
    keep_multicast_off()  # inherited by the followers too
    world, port = len(devices), free_port()
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=follower_main, name=f"ppqa-rank{rank}", daemon=True,
                                 args=(rank, world, port, model, devices[rank], config_fields))
                 for rank in range(1, world)]
    for p in processes:
        p.start()
    group = RankGroup(processes)
    try:
        join_group(0, world, port, devices[0])
        engine = Engine(model, device=devices[0],
                        config=EngineConfig(tensor_parallel=world, **config_fields))
    except BaseException:
        group._closing = True
        for p in processes:
            p.kill()
        raise
    group.engine = engine
    return engine, group
