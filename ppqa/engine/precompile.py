"""Compile helpers: the warm-up's Triton compilations spread over child processes.

On a machine whose Triton cache has never held this engine's kernels, `Engine.warmup` compiles
a few dozen kernel variants one after another (~20 s on the H200 for a 7B model,
results/h200/startup_cold_phases.json). A worker that starts helpers before it imports torch
gets them compiled in parallel instead, while it imports torch and loads its weights; before it
sizes its KV pool (which takes a share of the GPU memory then free) it waits for the helpers to
exit, and its own warm-up then finds the kernels on disk. Each helper builds a two-layer copy
of the model (the same dimensions, random weights, a small KV pool). Two layouts:

- `record` (the default): one helper runs every warm-up phase (`Engine.warmup_phases`) with a
  Triton hook that records each kernel variant a launch asks for and skips it (nothing is
  compiled or launched, so the phases take ~2-4 s and compute garbage, which no host-side
  choice reads: sampling is greedy and answers have fixed lengths), and writes the list of
  variants; the others (`COMPILERS`) wait for the list and compile its variants, each claiming
  the next one not yet claimed (`JITFunction.preload`, then loading it, which builds its
  launcher), so every variant is compiled once, in parallel. The recorder joins them once its
  list is out. This relies on a variant's cache key being the same in every process, which
  kernels/_keys.py ensures. On the H200 host it is ready 11.5 s after start where `phases` is
  18.3 s, and the first job compiles nothing
  (results/h200/startup_cold_record_s19c1.json, startup_cold_phases_s19c1.json).
- `phases`: each helper runs a group of the warm-up's phases (`HELPER_PHASES`) for real, which
  writes the kernels they meet into the shared cache; every helper compiles the kernels all
  phases share again (~7-10 s of its first phase). `start` takes it where the machine has too
  few cores for `MIN_COMPILERS` compilers beside the recorder and the worker: there the
  record layout compiles nearly one variant at a time, while four phase groups still overlap.

A marker file in the Triton cache (`ppqa-warm-<key>`) records that a warm-up of this model,
configuration and kernel source has completed there, or that helpers started for them all
finished well (`wait` writes it then: they compiled what the warm-up meets); helpers start only
where it is missing, so a warm machine starts none, and `ppqa run --warmup cold` runs no warm-up
where it is present, after helpers too. A helper that fails costs nothing but its time: the
marker stays absent and the worker's warm-up compiles whatever is missing.

The helpers' own side (the two-layer engine, recording, compiling) is `compile_helper.py`. This
module imports neither torch nor triton at the top: `start` runs before either is loaded.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARKER_PREFIX = "ppqa-warm-"
# The warm-up's phases, grouped per helper. Groups keep the warm-up's order: the later phases
# meet documents that the earlier ones left cached (and placed in the pool), paths of their own
# that a phase run alone does not meet. A helper's first phase also compiles the kernels every
# phase shares (~6.5 s of its 8-11 s). Seven one-phase helpers, each phase run twice, ended no
# sooner (ready 25.4 s against 25.0 with these four) and left the worker's warm-up two extend
# variants to compile (results/h200/startup_cold_helpers7_s12.json, startup_cold_helpers4_s12c4.json).
HELPER_PHASES = (("long", "few-long"), ("many", "cudnn"),
                 ("few-stock", "few-cascade", "few-parallel", "mixed"),
                 ("few-cascade", "choices", "tiles"))
# EngineConfig fields that change which kernels the warm-up meets and that a worker knows
# before torch resolves the rest (dtype and backend follow the device).
_WARMUP_FIELDS = ("max_batch_requests", "max_prefill_tokens")
WAIT_SECONDS = 120.0  # a helper still running after this is stopped (the worker compiles instead)
LAYOUTS = ("record", "phases")
# Compiling helpers beside the recorder in the `record` layout (at most; fewer where the machine
# has fewer cores than that plus two, one for the worker and one for the recorder).
COMPILERS = 8
# Fewer compilers than this and `start` takes the `phases` layout instead. A judgement from one
# run, not a sweep: 8 compilers and the recorder spent ~23 compile-seconds on the 16 variants,
# the busiest 4.9 s (results/h200/startup_cold_record_s19c1.json); 4 would need ~6 s after the
# list, still less than a phase group's first phase (10-11 s, startup_cold_phases_s19c1.json).
MIN_COMPILERS = 4

_started: list[Helper] = []  # helpers this process started and has not waited for
_marks: list[tuple[str, dict]] = []  # (model, fields) of those helpers: marked warm if all do well
last_wait: tuple[int, int, float] | None = None  # (finished well, started, seconds waited)
# The last wait's helpers: their phases, exit code, and their own timing report (`main`'s last
# line: seconds from the start call to its engine built, and to its phases done;
# compile_helper.py).
last_reports: list[dict] = []


@dataclasses.dataclass
class Helper:
    phases: tuple[str, ...]
    process: subprocess.Popen
    log: Path


def triton_cache_dir() -> Path:
    """Triton's cache folder, found as Triton finds it (TRITON_CACHE_DIR, else
    $TRITON_HOME/.triton/cache, else ~/.triton/cache), without importing Triton."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or os.path.expanduser("~/")) / ".triton" / "cache"


def marker(model: str, fields: dict) -> Path:
    """The file that says a warm-up of `model` with EngineConfig `fields` (those that change
    the kernels met; absent ones take EngineConfig's defaults) and today's kernel sources
    completed with this Triton cache."""
    from ppqa.config import EngineConfig, default_prefill_tokens

    defaults = vars(EngineConfig())
    values = {k: fields.get(k, defaults[k]) for k in _WARMUP_FIELDS}
    # Markers belong to a GPU's Triton cache: a field left to the device is the GPU's value,
    # as the engine that marks the cache resolves it.
    values["max_prefill_tokens"] = values["max_prefill_tokens"] or default_prefill_tokens("cuda")
    digest = hashlib.sha256()
    digest.update(json.dumps([model, values], sort_keys=True, default=str).encode())
    for source in sorted(Path(__file__).parent.parent.joinpath("kernels").glob("*.py")):
        digest.update(source.read_bytes())
    return triton_cache_dir() / f"{MARKER_PREFIX}{digest.hexdigest()[:20]}"


def mark_warm(model: str, fields: dict) -> None:
    """Record that the warm-up of `model` completed (a cache folder that cannot be written
    only costs the next start its helpers)."""
    path = marker(model, fields)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{model}\n")
    except OSError:
        pass


def likely_gpu(device: str | None) -> bool:
    """Whether `device` ('cuda:N', 'cuda', 'cpu', None for the default) names a GPU, judged
    without torch: the default counts as a GPU where an NVIDIA device node exists."""
    if device is None or device == "auto":
        return bool(glob.glob("/dev/nvidia[0-9]*"))
    return device.startswith("cuda")


def _compilers() -> int:
    """Compilers the `record` layout gets here: one core each, after the worker and recorder."""
    return min(COMPILERS, (os.cpu_count() or 1) - 2)


def default_layout() -> str:
    """`record`, unless this machine has cores for fewer than MIN_COMPILERS compilers."""
    return "record" if _compilers() >= MIN_COMPILERS else "phases"


def start(model: str, device: str | None, fields: dict | None = None,
          layout: str | None = None) -> list[Helper]:
    """Start the helpers for `model` on `device` where the Triton cache lacks the model's
    marker and the device is a GPU; [] otherwise. `fields`: the EngineConfig fields the engine
    will be built with; `layout`: one of LAYOUTS (the module's docstring), or None for
    `default_layout()`."""
    layout = layout or default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fields = dict(fields or {})
    if os.environ.get("TRITON_INTERPRET") == "1" or not likely_gpu(device):
        return []
    if marker(model, fields).exists():
        return []
    folder = Path(tempfile.mkdtemp(prefix="ppqa-compile-"))
    started = time.time()
    if layout == "phases":
        roles = [("--phases", ",".join(phases)) for phases in HELPER_PHASES]
    else:
        compilers = max(1, _compilers())
        roles = [("--record", str(folder))] + [("--compile", str(folder))] * compilers
    helpers = []
    for i, (flag, value) in enumerate(roles):
        log = folder / f"helper-{i}.log"
        with open(log, "w") as out:
            command = [sys.executable, "-m", "ppqa.engine.compile_helper", "--model", model,
                       "--device", device or "cuda", flag, value,
                       "--fields", json.dumps(fields), "--started", repr(started)]
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        phases = tuple(value.split(",")) if flag == "--phases" else (flag[2:],)
        helpers.append(Helper(phases, process, log))
    _started.extend(helpers)
    _marks.append((model, fields))
    return helpers


def wait(timeout: float = WAIT_SECONDS) -> tuple[int, int]:
    """Wait for the helpers this process started (stopping any still running after `timeout`
    seconds in all); (finished well, started). (0, 0) when none were started. When every one
    finished well, the cache is marked warm for what they compiled (`mark_warm`)."""
    global last_wait
    helpers, _started[:] = list(_started), []
    marks, _marks[:] = list(_marks), []
    if not helpers:
        return 0, 0
    began = time.monotonic()
    ok = 0
    for helper in helpers:
        try:
            ok += helper.process.wait(timeout=max(began + timeout - time.monotonic(), 0.1)) == 0
        except subprocess.TimeoutExpired:
            helper.process.kill()
            helper.process.wait()
    if ok == len(helpers):
        for model, fields in marks:
            mark_warm(model, fields)
    last_wait = (ok, len(helpers), time.monotonic() - began)
    last_reports[:] = [{"phases": list(h.phases), "rc": h.process.returncode, **_report(h.log)}
                       for h in helpers]
    return ok, len(helpers)


def _report(log: Path) -> dict:
    """A helper's timing report: the JSON object on its log's last line ({} if none)."""
    try:
        last = log.read_text(errors="replace").strip().splitlines()[-1]
        report = json.loads(last)
    except (OSError, IndexError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def stop() -> None:
    """Stop the helpers this process started (the worker gives up before loading)."""
    helpers, _started[:] = list(_started), []
    _marks.clear()
    for helper in helpers:
        if helper.process.poll() is None:
            helper.process.kill()
            helper.process.wait()
