"""Compile helpers (engine/precompile.py, engine/compile_helper.py): which warm-up phases they run, the marker that says a
Triton cache is warm, when they start, and a helper process run end to end on the CPU. On a GPU,
tests/gpu/test_precompile_gpu.py checks that they leave the worker's warm-up nothing to compile."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from ppqa import Engine
from ppqa.config import EngineConfig, default_prefill_tokens
from ppqa.engine import compile_helper, precompile


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # start() stays off under it
    return cache


def test_helpers_run_every_warmup_phase_once():
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    names = [name for name, _ in engine.warmup_phases()]
    assigned = {name for group in precompile.HELPER_PHASES for name in group}
    assert assigned == set(names) and len(set(names)) == len(names)
    for group in precompile.HELPER_PHASES:  # each group in the warm-up's order, repeats together
        distinct = list(dict.fromkeys(group))
        assert [n for n in names if n in group] == distinct
        assert [name for name, _ in itertools.groupby(group)] == distinct  # repeats adjacent


def test_the_marker_names_the_model_and_what_changes_the_kernels(triton_cache):
    base = precompile.marker("dummy:tiny-gqa", {})
    assert base.parent == triton_cache and base.name.startswith(precompile.MARKER_PREFIX)
    assert precompile.marker("dummy:tiny-gqa", {"max_batch_requests": 256}) == base  # the default
    assert precompile.marker("dummy:tiny-gqa", {"mem_fraction": 0.3}) == base  # pool size: no
    assert precompile.marker("dummy:tiny-gqa", {"max_batch_requests": 512}) != base
    assert precompile.marker("dummy:tiny-gqa", {"max_prefill_tokens": 4096}) != base
    # a chunk left to the device is the GPU's, which a GPU engine resolves it to
    assert precompile.marker("dummy:tiny-gqa", {"max_prefill_tokens": None}) == base
    gpu_chunk = default_prefill_tokens("cuda")
    assert precompile.marker("dummy:tiny-gqa", {"max_prefill_tokens": gpu_chunk}) == base
    assert precompile.marker("dummy:tiny-mha", {}) != base
    # the engine's own (resolved) config gives the same marker as the fields a worker passes:
    # device, dtype, backend and graphs resolved change nothing (this CPU engine's chunk is the
    # CPU's, so it is put back to what a GPU engine resolves)
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    resolved = dict(vars(engine.config), max_prefill_tokens=gpu_chunk)
    assert precompile.marker(engine.model_name, resolved) == base


def test_no_helpers_on_the_cpu_under_the_interpreter_or_on_a_warm_cache(triton_cache, monkeypatch):
    assert precompile.start("dummy:tiny-gqa", "cpu") == []
    precompile.mark_warm("dummy:tiny-gqa", {})
    assert precompile.marker("dummy:tiny-gqa", {}).is_file()
    assert precompile.start("dummy:tiny-gqa", "cuda:0") == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert precompile.start("dummy:tiny-mha", "cuda:0") == []
    assert precompile.wait() == (0, 0)


def test_a_helper_that_fails_is_counted_and_leaves_nothing_running(triton_cache, monkeypatch):
    # A device that does not exist: the helper process starts, fails to build, and exits.
    monkeypatch.setattr(precompile, "HELPER_PHASES", (("few-stock",),))
    helpers = precompile.start("dummy:tiny-gqa", "cuda:99", layout="phases")
    assert len(helpers) == 1
    assert precompile.wait(timeout=120) == (0, 1)
    assert helpers[0].process.returncode not in (0, None)
    assert precompile.last_wait[:2] == (0, 1)
    assert precompile.last_reports == [{"phases": ["few-stock"],  # no timing report: it failed
                                        "rc": helpers[0].process.returncode}]
    assert "Error" in helpers[0].log.read_text()  # the helper's own output says why
    assert not precompile.marker("dummy:tiny-gqa", {}).exists()  # the worker warms up itself
    assert precompile.wait() == (0, 0)  # waited for once


def test_helpers_that_all_finish_well_mark_the_cache_warm(triton_cache, monkeypatch):
    """So that `ppqa run --warmup cold` goes to work after them without a warm-up of its own
    (the kernels are on disk), and the next start starts none. Real helper processes, on the
    CPU (where they compile nothing, but run their phases and exit as on a GPU)."""
    monkeypatch.setattr(precompile, "likely_gpu", lambda device: True)
    monkeypatch.setattr(precompile, "HELPER_PHASES", (("few-stock",), ("mixed",)))
    fields = {"max_batch_requests": 16}
    helpers = precompile.start("dummy:tiny-gqa", "cpu", fields, layout="phases")
    assert len(helpers) == 2
    assert not precompile.marker("dummy:tiny-gqa", fields).exists()  # not before they end
    assert precompile.wait(timeout=240) == (2, 2), [h.log.read_text() for h in helpers]
    assert precompile.marker("dummy:tiny-gqa", fields).is_file()
    assert not precompile.marker("dummy:tiny-gqa", {}).exists()  # another configuration's
    assert precompile.start("dummy:tiny-gqa", "cpu", fields, layout="phases") == []


def test_a_helper_runs_its_phases_on_a_two_layer_copy():
    engine = compile_helper.shadow_engine("dummy:tiny-gqa", "cpu", {"max_batch_requests": 16})
    full = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    assert engine.model_config.num_layers == 2 < full.model_config.num_layers
    for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "max_position_embeddings"):
        assert getattr(engine.model_config, field) == getattr(full.model_config, field)
    assert engine.config.max_batch_requests == 16
    done = subprocess.run([sys.executable, "-m", "ppqa.engine.compile_helper", "--model",
                           "dummy:tiny-gqa", "--device", "cpu", "--phases", "few-stock,mixed,choices",
                           "--fields", '{"max_batch_requests": 16}', "--started", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])  # what `wait` reads
    assert [name for name, _ in report["phase_s"]] == ["few-stock", "mixed", "choices"]
    assert report["done_s"] > report["built_s"] > report["python_s"] > 1e9  # from the epoch
    assert compile_helper.main(["--model", "dummy:tiny-gqa", "--device", "cpu",
                            "--phases", "no-such-phase"]) == 2


def test_warmup_on_the_cpu_writes_no_marker(triton_cache):
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    engine.warmup()
    assert not precompile.marker("dummy:tiny-gqa", {}).exists()


def test_the_cpu_never_counts_its_kernels_cached(triton_cache):
    """`ppqa run --warmup cold` skips the warm-up only on a GPU with the marker: the CPU
    compiles no kernels, so a marker for the model there changes nothing."""
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    precompile.mark_warm("dummy:tiny-gqa", vars(engine.config))
    assert precompile.marker("dummy:tiny-gqa", vars(engine.config)).exists()
    assert not engine.kernels_cached()


def test_the_recorder_lists_each_variant_once_and_skips_it(tmp_path):
    """`record_variants` with the call Triton makes on a kernel variant it has not compiled
    (JITFunction._do_compile's jit_cache_hook): each variant listed once, in the order met,
    every launch skipped, a phase that fails recorded, the list written, the hook restored;
    a phase that launches no Triton kernel (`UNRECORDED`: cuDNN's builds) not run before the
    list is out."""
    from triton import knobs

    class Info:  # triton's JitFunctionInfo
        module, name = "ppqa.kernels.fake", "_kernel"

    skipped = []

    def launch(spec):
        skipped.append(knobs.runtime.jit_cache_hook(
            key=spec, repr=spec, fn=Info(), compile={"key": spec, "specialization_data": spec},
            is_manual_warmup=False, already_compiled=False))

    def garbage():
        launch("c")
        raise RuntimeError("nan in the logits")

    class Engine:
        def warmup_phases(self):
            return [("a", lambda: [launch(v) for v in ("x", "y", "x")]), ("b", garbage),
                    ("c", lambda: launch("z")), ("cudnn", lambda: unrecorded.append(1))]

    unrecorded = []

    before = knobs.runtime.jit_cache_hook
    result = compile_helper.record_variants(Engine(), tmp_path)
    assert result == {"variants": 4, "failed": ["b: RuntimeError: nan in the logits"]}
    listed = json.loads((tmp_path / "variants.json").read_text())
    assert [v["spec"] for v in listed] == ["x", "y", "c", "z"]
    assert listed[0] == {"module": "ppqa.kernels.fake", "name": "_kernel", "spec": "x"}
    assert skipped == [True] * 5 and knobs.runtime.jit_cache_hook is before
    assert compile_helper.UNRECORDED == ("cudnn",) and unrecorded == []
    compile_helper.run_unrecorded(Engine())  # after the list: those phases alone, for real
    assert unrecorded == [1] and skipped == [True] * 5


FAKE_KERNELS = """
import os

class Compiled:
    def __init__(self, spec):
        self.spec = spec

    def _init_handles(self):  # triton's CompiledKernel: loads it, builds its launcher
        with open(os.environ["COMPILED_LOG"], "a") as log:
            log.write(self.spec + "\\n")

class Kernel:
    def preload(self, spec):
        if spec == "bad":
            raise ValueError("cannot compile")
        return Compiled(spec)

class Wrapper:  # as triton.autotune's: the kernel is .fn
    fn = Kernel()

kernel, wrapped = Kernel(), Wrapper()
"""


def test_compilers_compile_each_listed_variant_once(tmp_path):
    """Three compiling helpers started before the list exists: they wait for it, and each
    variant is compiled and loaded by exactly one of them (a wrapped kernel unwrapped; one that
    fails to compile reported, not fatal)."""
    (tmp_path / "fake_kernels.py").write_text(FAKE_KERNELS)
    folder = tmp_path / "helpers"
    folder.mkdir()
    env = {**os.environ, "COMPILED_LOG": str(tmp_path / "compiled.log"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = ("import json, pathlib, sys; from ppqa.engine.compile_helper import compile_listed; "
            "print(json.dumps(compile_listed(pathlib.Path(sys.argv[1]))))")
    helpers = [subprocess.Popen([sys.executable, "-c", code, str(folder)], env=env, text=True,
                                stdout=subprocess.PIPE) for _ in range(3)]
    specs = [f"v{i}" for i in range(12)]
    compile_helper.write_list(folder, [{"module": "fake_kernels", "name": "kernel", "spec": v}
                                   for v in specs + ["bad"]]
                          + [{"module": "fake_kernels", "name": "wrapped", "spec": "w"}])
    reports = []
    for helper in helpers:
        out, _ = helper.communicate(timeout=120)
        assert helper.returncode == 0
        reports += json.loads(out.strip().splitlines()[-1])
    assert sorted((tmp_path / "compiled.log").read_text().split()) == sorted(specs + ["w"])
    assert len(reports) == 14
    failed = [seconds for _, seconds in reports if isinstance(seconds, str)]
    assert failed == ["ValueError: cannot compile"]


def test_the_record_layout_is_the_default_where_its_compilers_fit(monkeypatch):
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)
    assert precompile.default_layout() == "record"
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: precompile.MIN_COMPILERS + 1)
    assert precompile.default_layout() == "phases"  # the worker and recorder take a core each
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: None)
    assert precompile.default_layout() == "phases"


def test_record_helpers_that_fail_leave_nothing_running(triton_cache):
    # A device that does not exist: the recorder fails to build and writes an empty list, so
    # the compilers, which fail on the device as well, wait for nothing.
    helpers = precompile.start("dummy:tiny-gqa", "cuda:99", layout="record")
    assert helpers[0].phases == ("record",) and len(helpers) >= 2
    assert all(h.phases == ("compile",) for h in helpers[1:])
    assert precompile.wait(timeout=120) == (0, len(helpers))
    assert all(h.process.returncode not in (0, None) for h in helpers)
    assert json.loads((helpers[0].log.parent / "variants.json").read_text()) == []


# Triton 3.6 (the GPU image's) merges a callee's constexpr globals into its caller's cache key
# only if the callee's key was computed first; later versions compute it first. This child
# process runs that 3.6 rule on whichever Triton is installed, touches one function first, then
# prints every kernel function's key.
KEYS_UNDER_TRITON_36 = """
import importlib, json, pkgutil, sys
from triton.runtime import jit

def update_hash_36(self, func):
    self.used_global_vals.update(func.used_global_vals)  # before func.cache_key, as in 3.6
    self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode())

jit.DependenciesFinder._update_hash = update_hash_36
module, name = sys.argv[1].rsplit(".", 1)
first = getattr(importlib.import_module(module), name)
settled_at_import = first.hash is not None
first.cache_key
import ppqa.kernels
keys = {}
for info in pkgutil.iter_modules(ppqa.kernels.__path__):
    mod = importlib.import_module("ppqa.kernels." + info.name)
    for attr, fn in vars(mod).items():
        if isinstance(fn, jit.JITFunction) and fn.__module__ == mod.__name__:
            keys[info.name + "." + attr] = fn.cache_key
print(json.dumps([settled_at_import, keys]))
"""


@pytest.mark.parametrize("first", ["ppqa.kernels.decode_attention._decode_kernel",
                                   "ppqa.kernels._tile.tma_tiles",
                                   "ppqa.kernels.merge._merge_kernel"])
def test_kernel_cache_keys_do_not_depend_on_what_a_process_compiles_first(first):
    """A compile helper and a worker meet the kernels in different orders; they must look each
    variant up under the same key, or the worker compiles again what the helpers compiled
    (kernels/_keys.py). Each kernel module settles its functions' keys as it is imported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JITFunctions

    def keys(touched):
        out = subprocess.run([sys.executable, "-c", KEYS_UNDER_TRITON_36, touched], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    settled, reference = keys("ppqa.kernels.fused._rms_norm_kernel")
    settled_first, touched_first = keys(first)
    assert settled and settled_first  # computed at import, before anything was compiled
    assert touched_first == reference
    assert {"decode_attention._decode_kernel", "extend_attention._extend_kernel",
            "cascade._prefix_kernel", "_tile.tma_tiles"} <= set(reference)
