"""Compile helpers on a GPU: after they ran on an empty Triton cache, a worker's warm-up in a
fresh process compiles nothing more (every kernel variant it meets is in the cache), and it
marks the cache warm so that the next start starts no helpers."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL = "dummy:tiny-gqa"

WARMUP = """
import sys, time
from ppqa.engine import precompile
from triton.runtime.jit import JITFunction
compiled = []
original = JITFunction._do_compile
def counted(self, *a, **k):
    t0 = time.perf_counter(); out = original(self, *a, **k)
    compiled.append((self.__name__, time.perf_counter() - t0)); return out
JITFunction._do_compile = counted
from ppqa import Engine
from ppqa.config import EngineConfig
engine = Engine(sys.argv[1], device="cuda", config=EngineConfig(mem_fraction=0.05))
engine.warmup()
print("LOOKUPS", len(compiled))
"""


def _cache_entries(cache) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()} if cache.exists() else set()


@pytest.mark.parametrize("layout", ["record", "phases"])
def test_helpers_leave_the_warmup_nothing_to_compile(tmp_path, layout):
    cache = tmp_path / "triton-cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    helpers = subprocess.run(
        [sys.executable, "-c", "import json; from ppqa.engine import precompile; "
         f"n = len(precompile.start({MODEL!r}, 'cuda:0', layout={layout!r})); "
         "print(json.dumps([n, precompile.wait(), precompile.last_reports]))"],
        env=env, capture_output=True, text=True, timeout=600)
    assert helpers.returncode == 0, helpers.stderr
    started, (finished, waited), reports = json.loads(helpers.stdout.strip().splitlines()[-1])
    assert started > 1 and finished == waited == started, reports
    if layout == "record":  # every listed variant compiled once, by one of the helpers
        listed = reports[0]["variants"]
        compiled = [c for r in reports for c in r["compiled"]]
        assert listed > 0 and len(compiled) == listed, reports
        assert all(isinstance(seconds, float) for _, seconds in compiled), reports
        assert reports[0]["failed"] == [], reports
    compiled_by_helpers = _cache_entries(cache)
    assert compiled_by_helpers  # they wrote kernels

    worker = subprocess.run([sys.executable, "-c", WARMUP, MODEL], env=env, capture_output=True,
                            text=True, timeout=600)
    assert worker.returncode == 0, worker.stderr
    assert "LOOKUPS" in worker.stdout
    new = _cache_entries(cache) - compiled_by_helpers
    assert not new, f"the warm-up compiled {len(new)} kernel variants the helpers did not"
    from ppqa.engine import precompile

    marker = cache / precompile.marker(MODEL, {}).name
    assert marker.is_file()  # the next start needs no helpers


def test_kernels_cached_follows_the_models_marker(tmp_path, monkeypatch):
    """What `ppqa run --warmup cold` asks: the marker of this model and configuration, in the
    Triton cache the process uses."""
    from ppqa import Engine
    from ppqa.config import EngineConfig
    from ppqa.engine import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    engine = Engine(MODEL, device="cuda", config=EngineConfig(mem_fraction=0.05))
    assert not engine.kernels_cached()
    precompile.mark_warm(MODEL, {**vars(engine.config), "max_batch_requests": 8})
    assert not engine.kernels_cached()  # another configuration's kernels
    precompile.mark_warm(MODEL, vars(engine.config))
    assert engine.kernels_cached()
