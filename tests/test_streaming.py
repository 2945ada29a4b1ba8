"""Weights streamed from safetensors shards by byte runs (loading/streaming.py, hf._runs).

The runs come from our own reading of each shard's header; safetensors' `get_tensor` of the
same files is the reference. `stream_runs` runs its whole pipeline on the CPU (ring of buffers,
positioned reads on threads, chunks that cut tensors anywhere); on a GPU only the copies and
events differ (tests/gpu/test_streaming_gpu.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ppqa.engine.loading.hf import _runs
from ppqa.engine.loading.streaming import TensorRun, stream_runs
from ppqa.engine.loading.types import ModelLoadError


def _shards(tmp_path) -> dict[str, object]:
    """Two shards of tensors of every float dtype and awkward sizes; name -> shard path."""
    gen = torch.Generator().manual_seed(0)
    parts = [
        {"a.weight": torch.randn(37, 53, generator=gen).to(torch.bfloat16),
         "b.scalar": torch.tensor(3.25, dtype=torch.float32),
         "c.empty": torch.empty(0, 5, dtype=torch.float16),
         "d.bias": torch.randn(1001, generator=gen).to(torch.float16)},
        {"e.weight": torch.randn(5, 7, 11, generator=gen),
         "f.weight": torch.randn(300, generator=gen).to(torch.bfloat16)},
    ]
    files = {}
    for i, part in enumerate(parts):
        path = tmp_path / f"model-{i}.safetensors"
        save_file(part, str(path))
        files.update({name: path for name in part})
    return files


def _reference(files, name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("chunk_bytes,buffers,threads", [(1000, 3, 2), (64, 2, 1), (1 << 20, 8, 4)])
def test_streamed_tensors_equal_safetensors_own_reads(tmp_path, chunk_bytes, buffers, threads):
    files = _shards(tmp_path)
    names = sorted(files)
    runs = _runs(files, names)
    assert {r.name for r in runs} == set(names)
    # Shard by shard, in each shard's file order: reads move forward through every file.
    for earlier, later in zip(runs, runs[1:]):
        if earlier.path == later.path:
            assert earlier.offset + earlier.nbytes <= later.offset
    out = list(stream_runs(runs, torch.device("cpu"), chunk_bytes=chunk_bytes, buffers=buffers,
                           threads=threads))
    assert [name for name, _ in out] == [r.name for r in runs]
    for name, tensor in out:
        ref = _reference(files, name)
        assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, name
        assert torch.equal(tensor.reshape(-1).view(torch.uint8),
                           ref.reshape(-1).view(torch.uint8)), name  # bit for bit


def test_a_truncated_shard_is_named_with_its_tensor(tmp_path):
    files = _shards(tmp_path)
    shard = files["e.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        _runs(files, sorted(files))


def test_a_header_that_is_not_json_is_a_load_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((12).to_bytes(8, "little") + b"not json at all")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        _runs({"x": path}, ["x"])


def test_integer_tensors_leave_the_byte_runs(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"w": torch.ones(4), "ids": torch.arange(6, dtype=torch.int64)}, str(path))
    assert _runs({"w": path, "ids": path}, ["w", "ids"]) is None
    assert [r.name for r in _runs({"w": path}, ["w"])] == ["w"]


def test_a_run_past_the_end_fails_the_read(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(100)))
    run = TensorRun("x", path, 40, 80, torch.uint8, (80,))
    with pytest.raises(OSError, match="end of file"):
        list(stream_runs([run], torch.device("cpu"), chunk_bytes=16, buffers=2, threads=1))
    # The header says where data begins: our runs start after it.
    save_file({"t": torch.arange(10, dtype=torch.float32)}, str(path))
    (first,) = _runs({"t": path}, ["t"])
    size = int.from_bytes(path.read_bytes()[:8], "little")
    assert json.loads(path.read_bytes()[8:8 + size])["t"]["dtype"] == "F32"
    assert first.offset == 8 + size and first.nbytes == 40
