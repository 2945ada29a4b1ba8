"""Weights streamed to a GPU through the pinned ring (loading/streaming.py): the same bits as
safetensors' own reads, with chunks small enough that every buffer is refilled many times while
its earlier copies may still be in flight, and a whole HF folder loaded on the GPU equal to the
same folder loaded on the CPU (memory-mapped)."""

import pytest
import torch
from safetensors import safe_open

from ppqa.engine.loading.hf import _runs
from ppqa.engine.loading.loader import load_model
from ppqa.engine.loading.streaming import stream_runs
from tests.test_loader_hf import QWEN2, write_hf_dir
from tests.test_streaming import _shards

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("chunk_bytes,buffers", [(256, 2), (4096, 5)])
def test_streamed_to_the_gpu_bit_for_bit(tmp_path, chunk_bytes, buffers):
    files = _shards(tmp_path)
    runs = _runs(files, sorted(files))
    got = {}
    for name, tensor in stream_runs(runs, torch.device("cuda"), chunk_bytes=chunk_bytes,
                                    buffers=buffers, threads=3):
        got[name] = tensor.clone()  # what a consumer does with it, queued behind the copies
    assert set(got) == set(files)
    for name, tensor in got.items():
        with safe_open(str(files[name]), framework="pt") as f:
            ref = f.get_tensor(name)
        assert tensor.is_cuda and tensor.dtype == ref.dtype and tensor.shape == ref.shape
        assert torch.equal(tensor.cpu().reshape(-1).view(torch.uint8),
                           ref.reshape(-1).view(torch.uint8)), name


def test_a_folder_loads_the_same_on_the_gpu_as_on_the_cpu(tmp_path):
    write_hf_dir(tmp_path / "m", QWEN2, chat=True, bos=False)
    on_cpu = dict(load_model(str(tmp_path / "m"), device="cpu", dtype=torch.float32).weights)
    on_gpu = dict(load_model(str(tmp_path / "m"), device="cuda", dtype=torch.float32).weights)
    assert set(on_gpu) == set(on_cpu)
    for name, tensor in on_gpu.items():
        assert tensor.is_cuda and tensor.dtype == torch.float32, name
        assert torch.equal(tensor.cpu(), on_cpu[name]), name
