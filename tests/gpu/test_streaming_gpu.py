"""Weights streamed to a GPU through the pinned ring (loading/streaming.py): the same bits as
safetensors' own reads, with chunks small enough that every buffer is refilled many times while
its earlier copies may still be in flight; the same from a ring CUDA refuses to page-lock; and a
whole HF folder, and GGUF files of every type torch unpacks, loaded on the GPU equal to the same
files loaded on the CPU (memory-mapped)."""

import warnings

import pytest
import torch
from safetensors import safe_open

from ppqa.engine.loading.gguf import _weights
from ppqa.engine.loading.hf import _runs
from ppqa.engine.loading.loader import load_model
from ppqa.engine.loading.streaming import stream_runs
from tests.test_gguf_blocks import STREAMED, blocks_config, write_blocks_gguf
from tests.test_loader_gguf import Q, _vocab, original_weights, write_tiny_gguf
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


def test_a_ring_cuda_will_not_page_lock_still_delivers_the_weights(tmp_path):
    """The loader's own cudaHostRegister fails for real: the ring's memory is registered
    already (cudaErrorHostMemoryAlreadyRegistered). One warning; the copies come from that
    memory as it is, bit for bit; CUDA's error is cleared (each clone and the kernel after
    would raise it otherwise); the registration the loader did not make is left alone."""
    files = _shards(tmp_path)
    runs = _runs(files, sorted(files))
    cudart = torch.cuda.cudart()
    host = torch.empty(1 << 20, dtype=torch.uint8)
    assert int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = {name: tensor.clone()
                   for name, tensor in stream_runs(runs, torch.device("cuda"), chunk_bytes=512,
                                                   buffers=3, threads=2, host=host)}
        warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(warned) == 1 and "cannot page-lock" in warned[0], warned
        assert torch.ones(1000, device="cuda").mul(2).sum().item() == 2000.0
    finally:
        assert int(cudart.cudaHostUnregister(host.data_ptr())) == 0  # still registered: ours
    assert set(got) == set(files)
    for name, tensor in got.items():
        with safe_open(str(files[name]), framework="pt") as f:
            ref = f.get_tensor(name)
        assert torch.equal(tensor.cpu().reshape(-1).view(torch.uint8),
                           ref.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda q: q.name)
def test_gguf_tensors_stream_to_the_gpu_as_they_load_on_the_cpu(tmp_path, qtype):
    """A GGUF's tensors read to the GPU as byte runs (reads of 100 bytes) and unpacked there
    are, bit for bit, those the CPU reads from the memory map (Q5_0: gguf's numpy code, beside
    streamed F32 norms)."""
    path = write_blocks_gguf(tmp_path / f"blocks-{qtype.name}.gguf", qtype)
    on_cpu = list(_weights(path, blocks_config(), "llama", torch.device("cpu"), torch.float32))
    on_gpu = [(name, tensor.cpu()) for name, tensor in
              _weights(path, blocks_config(), "llama", torch.device("cuda"), torch.float32,
                       chunk_bytes=100)]
    assert [name for name, _ in on_gpu] == [name for name, _ in on_cpu] and len(on_cpu) == 6
    for (name, got), (_, want) in zip(on_gpu, on_cpu):
        assert got.shape == want.shape, name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_a_gguf_model_loads_the_same_on_the_gpu_as_on_the_cpu(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1, original_weights(len(_vocab())))
    on_cpu = dict(load_model(str(path), device="cpu", dtype=torch.bfloat16).weights)
    on_gpu = dict(load_model(str(path), device="cuda", dtype=torch.bfloat16).weights)
    assert set(on_gpu) == set(on_cpu)
    for name, tensor in on_gpu.items():
        assert tensor.is_cuda and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.cpu(), on_cpu[name]), name
