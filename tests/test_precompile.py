"""Compile helpers (engine/precompile.py): how they share the kernel variants out, the marker
that says a Triton cache is warm, when they start, and a helper process run end to end on the
CPU. On a GPU, tests/gpu/test_precompile_gpu.py checks that they leave the worker's warm-up
nothing to compile."""

import json
import os
import subprocess
import sys

import pytest

from ppqa import Engine
from ppqa.config import EngineConfig
from ppqa.engine import precompile


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # start() stays off under it
    return cache


def test_every_kernel_variant_has_one_owner_the_same_in_every_process():
    keys = [f"[('*bf16', 'D'), ('i32', '{i}')]{{'num_warps': {w}}}" for i in range(64)
            for w in (4, 8)]
    shards = 5
    owners = [precompile.owner(k, shards) for k in keys]
    assert set(owners) == set(range(shards))  # 128 keys reach every shard
    hooks = [precompile.shard_hook(i, shards) for i in range(shards)]
    for key, own in zip(keys, owners):
        skipped = [hook(key=key, repr="", fn=None, compile={}, is_manual_warmup=False,
                        already_compiled=False) for hook in hooks]
        assert skipped.count(False) == 1 and not skipped[own]  # compiled by its owner alone
    # Python salts str hashes per process: ownership must not depend on it.
    other = subprocess.run([sys.executable, "-c", "import json, sys; "
                            "from ppqa.engine import precompile; "
                            "print(json.dumps([precompile.owner(k, 5) for k in json.load(sys.stdin)]))"],
                           input=json.dumps(keys), capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"})
    assert json.loads(other.stdout) == owners


def test_the_marker_names_the_model_and_what_changes_the_kernels(triton_cache):
    base = precompile.marker("dummy:tiny-gqa", {})
    assert base.parent == triton_cache and base.name.startswith(precompile.MARKER_PREFIX)
    assert precompile.marker("dummy:tiny-gqa", {"max_batch_requests": 256}) == base  # the default
    assert precompile.marker("dummy:tiny-gqa", {"mem_fraction": 0.3}) == base  # pool size: no
    assert precompile.marker("dummy:tiny-gqa", {"max_batch_requests": 512}) != base
    assert precompile.marker("dummy:tiny-gqa", {"max_prefill_tokens": 4096}) != base
    assert precompile.marker("dummy:tiny-mha", {}) != base
    # the engine's own (resolved) config gives the same marker as the fields a worker passes
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    assert precompile.marker(engine.model_name, vars(engine.config)) == base


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
    monkeypatch.setattr(precompile, "SHARDS", 1)
    helpers = precompile.start("dummy:tiny-gqa", "cuda:99")
    assert len(helpers) == 1
    assert precompile.wait(timeout=120) == (0, 1)
    assert helpers[0].process.returncode not in (0, None)
    assert precompile.last_wait[:2] == (0, 1)
    assert precompile.last_reports == [{"shard": "0/1",  # no timing report: it failed
                                        "rc": helpers[0].process.returncode}]
    assert "Error" in helpers[0].log.read_text()  # the helper's own output says why
    assert precompile.wait() == (0, 0)  # waited for once


def test_a_helper_runs_its_phases_on_a_two_layer_copy():
    engine = precompile.shadow_engine("dummy:tiny-gqa", "cpu", {"max_batch_requests": 16})
    full = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    assert engine.model_config.num_layers == 2 < full.model_config.num_layers
    for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "max_position_embeddings"):
        assert getattr(engine.model_config, field) == getattr(full.model_config, field)
    assert engine.config.max_batch_requests == 16
    # A shard's helper runs every phase, in the warm-up's order (as `start` runs it).
    fields = {"max_batch_requests": 16, "max_prefill_tokens": 256}
    done = subprocess.run([sys.executable, "-m", "ppqa.engine.precompile", "--model",
                           "dummy:tiny-gqa", "--device", "cpu", "--shard", "1/2",
                           "--fields", json.dumps(fields), "--started", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])  # what `wait` reads
    small = precompile.shadow_engine("dummy:tiny-gqa", "cpu", fields)
    assert [name for name, _ in report["phase_s"]] == [n for n, _ in small.warmup_phases()]
    assert report["done_s"] > report["built_s"] > report["python_s"] > 1e9  # from the epoch
    assert precompile.main(["--model", "dummy:tiny-gqa", "--device", "cpu",
                            "--phases", "no-such-phase"]) == 2


def test_warmup_on_the_cpu_writes_no_marker(triton_cache):
    engine = Engine("dummy:tiny-gqa", device="cpu", config=EngineConfig(kv_token_budget=4096))
    engine.warmup()
    assert not precompile.marker("dummy:tiny-gqa", {}).exists()
