"""GPU time of a stretch of host code, by kernel kind and by the engine phase that launched it.

`Profile` runs torch.profiler (CPU and CUDA activities) over a block; inside it, `phase(name)`
marks host code (a `record_function` range) whose launches count for `name`. `summary()` then
joins each GPU activity (kernel, copy, set) to the runtime call that launched it (kineto's
correlation id; a CUDA graph's kernels to its `cudaGraphLaunch`) and that call to the innermost
phase around it, and adds up:
- per phase: GPU seconds by kernel kind (`KINDS`) and the top kernels by name;
- the union of GPU busy intervals against the block's wall time (the GPU idle share is host
  time the device waited for: launches, synchronisations, Python between steps).
The profiler's own overhead lengthens host time (every aten op is recorded), so the wall time
here is longer than an unprofiled run's; the kernels' own durations are not affected.

    with Profile() as prof:
        with prof.phase("prefill"): ...
    print(prof.summary())
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import defaultdict

# Kernel kinds by a substring of the kernel's name, first match wins (lower case).
KINDS = (
    ("attention: ours, extend", ("_extend_kernel",)),
    ("attention: ours, decode", ("_decode_kernel",)),
    ("attention: ours, cascade document", ("_prefix_kernel",)),
    ("attention: ours, merge", ("_merge_kernel",)),
    ("attention: torch fused (cudnn/flash)", ("cudnn", "flash", "fmha", "sdpa", "attention")),
    ("norm/rope/act/kv store", ("_rms_norm", "_rope", "_silu", "_store_kernel")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "s16816")),
    ("copy/set", ("memcpy", "memset")),
)
PHASE_PREFIX = "ppqa:"


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Profile:
    def __init__(self) -> None:
        self._prof = None
        self.wall_s = 0.0

    def __enter__(self) -> Profile:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self._prof.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str):
        from torch.autograd.profiler import record_function

        with record_function(PHASE_PREFIX + name):
            yield

    def summary(self, top: int = 12) -> dict:
        from torch.autograd import DeviceType

        events = self._prof.profiler.kineto_results.events()
        ranges: list[tuple[int, int, str]] = []  # phase ranges on the host
        launches: dict[int, int] = {}  # correlation id -> the launching call's start, ns
        device: list = []
        for e in events:
            if e.device_type() == DeviceType.CPU:
                name = e.name()
                if name.startswith(PHASE_PREFIX):
                    ranges.append((e.start_ns(), e.end_ns(), name[len(PHASE_PREFIX):]))
                elif e.correlation_id():
                    launches[e.correlation_id()] = e.start_ns()
            elif e.device_type() == DeviceType.CUDA and not e.name().startswith(PHASE_PREFIX):
                device.append(e)  # (kineto mirrors each phase range onto the GPU's timeline)
        ranges.sort()  # by start
        starts = [r[0] for r in ranges]

        def phase_at(ns: int | None) -> str:
            if ns is None:
                return "unattributed"
            i = bisect.bisect_right(starts, ns) - 1
            # Phases are disjoint or nested one deep: the last range that starts before ns,
            # else the one before it (its parent, when ns falls after the nested one's end).
            for a, b, name in (ranges[j] for j in (i, i - 1) if j >= 0):
                if a <= ns <= b:
                    return name
            return "other"

        by_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        names: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
        intervals = []
        for e in device:
            us = e.duration_ns() / 1e3
            intervals.append((e.start_ns() / 1e3, e.end_ns() / 1e3))
            ph = phase_at(launches.get(e.correlation_id()))
            by_phase[ph][kind_of(e.name())] += us / 1e6
            slot = names[ph][e.name()[:90]]
            slot[0] += us / 1e6
            slot[1] += 1
        busy_s = _union_us(intervals) / 1e6
        host_s = defaultdict(float)
        for a, b, name in ranges:
            host_s[name] += (b - a) / 1e9
        return {
            "wall_s": self.wall_s, "gpu_busy_s": busy_s,
            "gpu_busy_share": busy_s / self.wall_s if self.wall_s else None,
            "phase_host_s": dict(host_s),
            "gpu_s_by_phase_and_kind": {p: dict(sorted(k.items(), key=lambda kv: -kv[1]))
                                        for p, k in by_phase.items()},
            "gpu_s_by_phase": {p: sum(k.values()) for p, k in by_phase.items()},
            "top_kernels": {p: sorted(([n, round(s, 4), c] for n, (s, c) in v.items()),
                                      key=lambda r: -r[1])[:top]
                            for p, v in names.items()},
        }


def print_summary(s: dict) -> None:
    print(f"  profiled: wall {s['wall_s']:.2f} s, GPU busy {s['gpu_busy_s']:.2f} s "
          f"({100 * (s['gpu_busy_share'] or 0):.0f}%); host s by phase "
          f"{ {k: round(v, 2) for k, v in s['phase_host_s'].items()} }")
    for phase, kinds in s["gpu_s_by_phase_and_kind"].items():
        total = s["gpu_s_by_phase"][phase]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if v >= 0.005)
        print(f"  GPU {phase}: {total:.2f} s = {parts}")
