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

This module imports neither torch nor triton at the top: `start` runs before either is loaded.
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
HELPER_PHASES = (("long", "few-long"), ("many",),
                 ("few-stock", "few-cascade", "few-parallel", "mixed"),
                 ("few-cascade", "choices", "tiles"))
# EngineConfig fields that change which kernels the warm-up meets and that a worker knows
# before torch resolves the rest (dtype and backend follow the device).
_WARMUP_FIELDS = ("max_batch_requests", "max_prefill_tokens")
_WAIT_SECONDS = 120.0  # a helper still running after this is stopped (the worker compiles instead)
LAYOUTS = ("record", "phases")
# Compiling helpers beside the recorder in the `record` layout (at most; fewer where the machine
# has fewer cores than that plus two, one for the worker and one for the recorder).
COMPILERS = 8
# Fewer compilers than this and `start` takes the `phases` layout instead. A judgement from one
# run, not a sweep: 8 compilers and the recorder spent ~23 compile-seconds on the 16 variants,
# the busiest 4.9 s (results/h200/startup_cold_record_s19c1.json); 4 would need ~6 s after the
# list, still less than a phase group's first phase (10-11 s, startup_cold_phases_s19c1.json).
MIN_COMPILERS = 4
_LIST = "variants.json"  # the recorder's list, in the helpers' folder

_started: list[Helper] = []  # helpers this process started and has not waited for
_marks: list[tuple[str, dict]] = []  # (model, fields) of those helpers: marked warm if all do well
last_wait: tuple[int, int, float] | None = None  # (finished well, started, seconds waited)
# The last wait's helpers: their phases, exit code, and their own timing report (`main`'s last
# line: seconds from the start call to its engine built, and to its phases done).
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
    from ppqa.config import EngineConfig

    defaults = vars(EngineConfig())
    digest = hashlib.sha256()
    digest.update(json.dumps([model, {k: fields.get(k, defaults[k]) for k in _WARMUP_FIELDS}],
                             sort_keys=True, default=str).encode())
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
            command = [sys.executable, "-m", "ppqa.engine.precompile", "--model", model,
                       "--device", device or "cuda", flag, value,
                       "--fields", json.dumps(fields), "--started", repr(started)]
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        phases = tuple(value.split(",")) if flag == "--phases" else (flag[2:],)
        helpers.append(Helper(phases, process, log))
    _started.extend(helpers)
    _marks.append((model, fields))
    return helpers


def wait(timeout: float = _WAIT_SECONDS) -> tuple[int, int]:
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


def shadow_engine(model: str, device: str, fields: dict):
    """An Engine with the model's dimensions, tokenizer and configuration but two layers of
    random weights, and a KV pool large enough for the warm-up (not a share of the GPU)."""
    import torch

    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine
    from ppqa.engine.loading import presets
    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.loading.types import LazyWeights, LoadedModel
    from ppqa.engine.runtime.kv_cache import KVPool

    config = EngineConfig(**fields)
    dtype = getattr(torch, config.dtype or ("bfloat16" if device.startswith("cuda")
                                            else "float32"))
    loaded = load_model(model, device=device, dtype=dtype)  # config and tokenizer; weights lazy
    # Two layers: the second meets what only layers after the first do (the residual norm).
    shadow = dataclasses.replace(loaded.config, num_layers=min(2, loaded.config.num_layers))
    weights = LazyWeights(lambda: presets.dummy_weights(shadow, 0.02, device=torch.device(device),
                                                        dtype=dtype, seed=0),
                          sum(1 for _ in presets.weight_shapes(shadow)))
    if torch.device(device).type == "cuda":
        # The req_to_token rows keep the length the worker's large pool gives them (their
        # stride is part of what a kernel is compiled for); the pool holds the warm-up's tokens.
        row = config.max_row_tokens or 4 * shadow.max_position_embeddings
        tokens = row + 2 * config.max_prefill_tokens + 64 * config.max_batch_requests
        slot_bytes = KVPool.bytes_per_slot(1, shadow.num_kv_heads, shadow.head_dim, dtype)
        free, _ = torch.cuda.mem_get_info(torch.device(device))  # other helpers take some
        config = dataclasses.replace(config, max_row_tokens=row, mem_fraction=min(
            1.0, tokens * slot_bytes / max(free // 2, 1)))
    return Engine.from_loaded(LoadedModel(shadow, weights, loaded.tokenizer,
                                          source=f"{loaded.source}, two layers for compiling"),
                              device=device, config=config, model_name=model)


def record_variants(engine, folder: Path) -> dict:
    """Run every warm-up phase of `engine` with a Triton hook that records each kernel variant a
    launch asks for and skips it (neither compiled nor launched), then write the list to
    `folder` for the compiling helpers. Returns {"variants": count, "failed": [phase: error]}:
    a phase that trips on the garbage the skipped kernels leave ends early, the next still run,
    and the list is written whatever happens."""
    from triton import knobs

    variants: dict[str, dict] = {}

    def hook(*, fn, compile, **_) -> bool:
        spec = compile["specialization_data"]
        variants.setdefault(spec, {"module": fn.module, "name": fn.name, "spec": spec})
        return True  # skip it

    failed = []
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        for name, phase in engine.warmup_phases():
            try:
                phase()
            except Exception as exc:  # noqa: BLE001 - recorded; the list is still useful
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        knobs.runtime.jit_cache_hook = previous
        write_list(folder, list(variants.values()))
    return {"variants": len(variants), "failed": failed}


def write_list(folder: Path, variants: list[dict]) -> None:
    """The recorder's list of variants ({"module", "name", "spec"}: where the kernel is and
    Triton's specialization data), written so that compilers see the whole list or none."""
    partial = folder / (_LIST + ".part")
    partial.write_text(json.dumps(variants))
    os.replace(partial, folder / _LIST)


def _imports_for_compiling(device: str) -> None:
    """What compiling needs before the list is out: torch and Triton imported, the device's
    context and Triton's driver up, the kernel modules loaded."""
    import importlib
    import pkgutil

    import torch
    from triton.runtime import driver

    import ppqa.kernels

    torch.cuda.set_device(torch.device(device).index or 0)  # 'cuda' names the first GPU
    driver.active.get_current_target()
    for module in pkgutil.iter_modules(ppqa.kernels.__path__):
        importlib.import_module(f"ppqa.kernels.{module.name}")


def jit_function(module: str, name: str):
    """The Triton JIT function `name` (a qualified name) of `module`, as a jit_cache_hook names
    it; a wrapper's (autotune, heuristics) is unwrapped."""
    import importlib

    kernel = importlib.import_module(module)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    while not hasattr(kernel, "preload") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def compile_listed(folder: Path, wait_seconds: float = _WAIT_SECONDS) -> list:
    """Compile the variants of the recorder's list in `folder` (waiting for it) that no other
    helper has claimed, each claimed by creating its claim file; [[kernel, seconds or error]]."""
    path = folder / _LIST
    deadline = time.monotonic() + wait_seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no list of kernel variants in {folder} after {wait_seconds} s")
        time.sleep(0.02)
    done = []
    for i, variant in enumerate(json.loads(path.read_text())):
        try:
            os.close(os.open(folder / f"claim-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another helper has it
        t0 = time.perf_counter()
        try:
            compiled = jit_function(variant["module"], variant["name"]).preload(variant["spec"])
            # Loading it builds its launcher, a C module per signature that Triton keeps in
            # the cache as well; a worker would otherwise build each at its first launch.
            compiled._init_handles()
            done.append([variant["name"], round(time.perf_counter() - t0, 3)])
        except Exception as exc:  # noqa: BLE001 - the worker's warm-up compiles it instead
            done.append([variant["name"], f"{type(exc).__name__}: {exc}"])
    return done


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Run warm-up phases on a two-layer copy of a "
                                             "model, filling the Triton cache (a compile helper).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", required=True)
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--phases", help="warm-up phase names, comma-separated (layout `phases`)")
    role.add_argument("--record", metavar="FOLDER",
                      help="record the warm-up's kernel variants into FOLDER, then compile")
    role.add_argument("--compile", metavar="FOLDER",
                      help="compile the variants FOLDER's recorder lists")
    ap.add_argument("--fields", default="{}", help="EngineConfig fields as JSON")
    ap.add_argument("--started", type=float, default=None,
                    help="when the worker started the helpers (epoch seconds): the report's origin")
    args = ap.parse_args(argv)
    origin = time.time() if args.started is None else args.started
    imported = time.time() - origin  # torch is not imported yet: `shadow_engine` does that
    if args.compile:
        _imports_for_compiling(args.device)
        built = time.time() - origin
        compiled = compile_listed(Path(args.compile))
        print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                          "compiled": compiled, "done_s": round(time.time() - origin, 3)}))
        return 0
    try:
        engine = shadow_engine(args.model, args.device, json.loads(args.fields))
    except BaseException:
        if args.record:
            write_list(Path(args.record), [])  # the compilers stop waiting
        raise
    if args.record:
        built = time.time() - origin
        recorded = record_variants(engine, Path(args.record))
        listed = time.time() - origin
        compiled = compile_listed(Path(args.record))
        print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                          "listed_s": round(listed, 3), **recorded, "compiled": compiled,
                          "done_s": round(time.time() - origin, 3)}))
        return 0
    phases = dict(engine.warmup_phases())
    wanted = args.phases.split(",")
    unknown = [name for name in wanted if name not in phases]
    if unknown:
        print(f"unknown warm-up phases {unknown}; known: {list(phases)}", file=sys.stderr)
        return 2
    built = time.time() - origin
    seconds = []
    for name in wanted:
        t0 = time.perf_counter()
        phases[name]()
        seconds.append([name, round(time.perf_counter() - t0, 3)])
    # The last line is the report `wait` reads: seconds since the worker started the helpers.
    print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                      "phase_s": seconds, "done_s": round(time.time() - origin, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
