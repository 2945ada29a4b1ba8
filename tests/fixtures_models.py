"""Shared model fixtures: one downloaded SmolLM2 per machine.

`smollm2_gguf` (session) pulls the embedded model once into a cache shared across tests and runs
(`$PPQA_TEST_MODELS`, default `~/.cache/ppqa-test-models`); `smollm2` (per test) links that file
into the test's own `$PPQA_HOME` (tests/conftest.py points it at a temp dir), so `Engine("smollm2")`
and `load_model("smollm2")` find it without another download. `hf_smollm2` (per module) is transformers'
own model from the same file. The transformers twin that the loader tests compare with is
`tests.helpers.hf_twin`.

Registered for the whole suite by `pytest_plugins = ["tests.fixtures_models"]` in tests/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ppqa.engine.loading import model_cache


def shared_models_dir() -> Path:
    return Path(os.environ.get("PPQA_TEST_MODELS") or Path.home() / ".cache" / "ppqa-test-models")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF in the shared test cache (downloaded on the first run on a machine)."""
    return model_cache.ensure("smollm2", root=shared_models_dir())


@pytest.fixture
def smollm2(smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The SmolLM2 GGUF linked into this test's $PPQA_HOME; returns the linked path."""
    if not os.environ.get("PPQA_HOME"):  # never touch the user's real data dir
        monkeypatch.setenv("PPQA_HOME", str(tmp_path / "ppqa-home"))
    target = model_cache.embedded_path("smollm2")
    if not model_cache.is_cached("smollm2"):
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(smollm2_gguf)
    return target


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf: Path):
    """transformers' own LlamaForCausalLM from the SmolLM2 GGUF (fp32, eval): the reference
    that no one here wrote. Module-scoped: each test file that needs it loads it once."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32,
        local_files_only=True)
    return model.eval()
