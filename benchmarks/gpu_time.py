"""GPU time of a stretch of host code, by kernel kind and by the engine phase that launched it.

`Profile` runs torch.profiler (CPU and CUDA activities) over a block; inside it, `phase(name)`
marks host code (a `record_function` range) whose launches count for `name`. `summary()` then
joins each GPU activity (kernel, copy, set) to the runtime call that launched it (kineto's
correlation id; a CUDA graph's kernels to its `cudaGraphLaunch`) and that call to the innermost
phase around it, and adds up:
- per phase: GPU seconds by kernel kind (`KINDS`) and the top kernels by name (each with
  its launches, those through a CUDA graph, and the streams it ran on);
- the union of GPU busy intervals against the block's wall time (the GPU idle share is host
  time the device waited for: launches, synchronisations, Python between steps);
- the GPU's idle time by what the host was doing meanwhile: each idle stretch is charged to
  the innermost phase open on the host at each of its instants, as a path ("decode/read"),
  and its length joins a histogram of idle stretches.
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
from collections import Counter, defaultdict

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


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted busy intervals covering `intervals`."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _idle_gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] outside the merged `busy` intervals."""
    gaps, t = [], start
    for a, b in busy:
        if b <= t:
            continue
        if a >= end:
            break
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if t < end:
        gaps.append((t, end))
    return gaps


def idle_by_path(gaps: list[tuple[float, float]], ranges: list[tuple[float, float, str]]) -> dict:
    """Seconds of `gaps` (µs) under each innermost path of the nested host `ranges` (µs, properly
    nested, as one thread's record_function ranges are); "-" where no range is open."""
    points = sorted([(a, 1, i) for i, (a, _, _) in enumerate(ranges)]
                    + [(b, 0, i) for i, (_, b, _) in enumerate(ranges)])
    out: dict[str, float] = defaultdict(float)
    stack: list[int] = []
    g, p = 0, 0
    gaps = sorted(gaps)
    cursor = gaps[0][0] if gaps else 0.0
    while g < len(gaps):
        a, b = gaps[g]
        cursor = max(cursor, a)
        nxt = points[p][0] if p < len(points) else float("inf")
        if nxt <= cursor:  # a range opens or closes at or before the cursor
            _, opens, i = points[p]
            if opens:
                stack.append(i)
            elif i in stack:
                stack.remove(i)
            p += 1
            continue
        upto = min(b, nxt)
        path = "/".join(ranges[i][2] for i in stack) or "-"
        out[path] += (upto - cursor) / 1e6
        cursor = upto
        if upto >= b:
            g += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# Idle stretches by length, µs: upper bounds of the histogram's bins.
GAP_BINS_US = (10, 100, 1000, 10000, float("inf"))


def gap_histogram(gaps: list[tuple[float, float]]) -> dict:
    """Idle stretches (µs) by length: count and seconds per bin of GAP_BINS_US."""
    names = ["<10us", "<100us", "<1ms", "<10ms", ">=10ms"]
    bins = {n: [0, 0.0] for n in names}
    for a, b in gaps:
        name = names[bisect.bisect_right(GAP_BINS_US, b - a)]
        bins[name][0] += 1
        bins[name][1] += (b - a) / 1e6
    return {n: {"count": c, "seconds": round(s, 4)} for n, (c, s) in bins.items()}


def long_gaps(gaps, busy, ranges, host_ops, min_ms: float = 5.0, top: int = 25,
              ops_each: int = 5) -> list[dict]:
    """The longest idle stretches (µs) of at least `min_ms`: when (seconds after the first
    device activity), how long, the host phase path at their middle, and the host events
    (aten ops, CUDA runtime calls; ns) that overlap them most: what the host was doing."""
    chosen = sorted((g for g in gaps if g[1] - g[0] >= min_ms * 1e3), key=lambda g: g[0] - g[1])
    chosen = sorted(chosen[:top])
    if not chosen:
        return []
    starts = [a for a, _ in chosen]
    overlap: list[dict[str, float]] = [defaultdict(float) for _ in chosen]
    for a_ns, b_ns, name in host_ops:
        a, b = a_ns / 1e3, b_ns / 1e3
        i = bisect.bisect_right(starts, b) - 1
        while i >= 0 and chosen[i][1] > a:  # gaps are disjoint: scan back while they overlap
            o = min(b, chosen[i][1]) - max(a, chosen[i][0])
            if o > 0:
                overlap[i][name] += o / 1e3
            i -= 1
    out = []
    first = busy[0][0]
    for (a, b), ops in zip(chosen, overlap):
        mid = (a + b) / 2
        path = idle_by_path([(mid, mid + 1e-3)], [(x / 1e3, y / 1e3, n) for x, y, n in ranges])
        out.append({"at_s": round((a - first) / 1e6, 4), "ms": round((b - a) / 1e3, 2),
                    "path": next(iter(path), "-"),
                    "host_ops_ms": [[n, round(v, 2)] for n, v in
                                    sorted(ops.items(), key=lambda kv: -kv[1])[:ops_each]]})
    return sorted(out, key=lambda g: -g["ms"])


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
        # correlation id -> the launching call's start (ns) and name (cudaLaunchKernel,
        # cudaGraphLaunch, ...)
        launches: dict[int, tuple[int, str]] = {}
        device: list = []
        host_ops: list[tuple[int, int, str]] = []  # every other host event: ops, runtime calls
        for e in events:
            if e.device_type() == DeviceType.CPU:
                name = e.name()
                if name.startswith(PHASE_PREFIX):
                    ranges.append((e.start_ns(), e.end_ns(), name[len(PHASE_PREFIX):]))
                    continue
                if e.correlation_id():
                    launches[e.correlation_id()] = (e.start_ns(), name)
                host_ops.append((e.start_ns(), e.end_ns(), name))
            elif e.device_type() == DeviceType.CUDA and not e.name().startswith(PHASE_PREFIX):
                device.append(e)  # (kineto mirrors each phase range onto the GPU's timeline)
        ranges.sort(key=lambda r: (r[0], -r[1]))  # by start, an outer range before its inner
        # Kernels count for the outermost phase around their launch: outermost ranges are
        # disjoint (one thread's ranges nest).
        outer: list[tuple[int, int, str]] = []
        for r in ranges:
            if not outer or r[0] >= outer[-1][1]:
                outer.append(r)
        starts = [r[0] for r in outer]

        def phase_at(ns: int | None) -> str:
            if ns is None:
                return "unattributed"
            i = bisect.bisect_right(starts, ns) - 1
            if i >= 0 and outer[i][0] <= ns <= outer[i][1]:
                return outer[i][2]
            return "other"

        by_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        # per phase and kernel name: [seconds, launches, launches through a CUDA graph,
        # {stream id: launches}]
        names: dict[str, dict[str, list]] = defaultdict(
            lambda: defaultdict(lambda: [0.0, 0, 0, defaultdict(int)]))
        # per phase: the host call each kernel's correlation id leads to (how a phase's kernels
        # were launched: eagerly, through a graph, or matched to nothing)
        launched_by: dict[str, Counter] = defaultdict(Counter)
        intervals = []
        for e in device:
            us = e.duration_ns() / 1e3
            intervals.append((e.start_ns() / 1e3, e.end_ns() / 1e3))
            launched_at, via = launches.get(e.correlation_id(), (None, ""))
            ph = phase_at(launched_at)
            by_phase[ph][kind_of(e.name())] += us / 1e6
            slot = names[ph][e.name()[:90]]
            slot[0] += us / 1e6
            slot[1] += 1
            slot[2] += "graphlaunch" in via.lower()
            launched_by[ph][via or "unmatched"] += 1
            slot[3][e.device_resource_id() if hasattr(e, "device_resource_id") else -1] += 1
        busy = _merged(intervals)
        busy_s = sum(b - a for a, b in busy) / 1e6
        # The idle stretches between the first and the last device activity (the block's ends
        # lie on another clock than kineto's when the profiler starts late).
        gaps = _idle_gaps(busy, busy[0][0], busy[-1][1]) if busy else []
        idle = idle_by_path(gaps, [(a / 1e3, b / 1e3, n) for a, b, n in ranges])
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
            "gpu_idle_s_by_host_path": {p: round(v, 4) for p, v in idle.items()},
            "kernels_launched_by": {p: dict(c.most_common(8)) for p, c in launched_by.items()},
            "gpu_idle_gaps": gap_histogram(gaps),
            "long_idle_gaps": long_gaps(gaps, busy, ranges, host_ops),
            # [name, seconds, launches, of them through a CUDA graph, {stream: launches}]
            "top_kernels": {p: sorted(([n, round(s, 4), c, g, dict(streams)]
                                       for n, (s, c, g, streams) in v.items()),
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
    idle = s.get("gpu_idle_s_by_host_path", {})
    if idle:
        print("  GPU idle by host path:", ", ".join(f"{p} {v:.3f}" for p, v in list(idle.items())[:14]))
        print("  GPU idle stretches:", {k: (v["count"], v["seconds"]) for k, v in s["gpu_idle_gaps"].items()})
    for g in s.get("long_idle_gaps", [])[:12]:
        print(f"    idle {g['ms']:7.1f} ms at {g['at_s']:6.2f} s in {g['path']}: "
              + "; ".join(f"{n[:40]} {v:.1f}" for n, v in g["host_ops_ms"]))
