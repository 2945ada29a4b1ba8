"""GGUF block types through torch: each type torch unpacks gives `gguf.quants`' bits, from the
memory map a chunk at a time and from the tensor's bytes read as a run (`streaming.stream_runs`,
the GPU's path, which runs synchronously on the CPU), and a file cut short while streamed
names its tensor. tests/gpu/test_streaming_gpu.py runs the streamed files on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ppqa.engine.loading.loader import ModelLoadError
from tests.test_loader_gguf import HEAD_DIM, HEADS, KV_HEADS, Q, _llama_cpp_permute


def _blocks_of(qtype, weights: np.ndarray) -> np.ndarray:
    """`weights` in `qtype`'s layout: quantized by the gguf package where it can, else random
    bytes with finite f16 scales (any bytes are a valid k-quant block)."""
    if qtype == Q.F32:
        return weights
    if qtype == Q.F16:
        return weights.astype(np.float16)
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return gguf.quants.quantize(weights, qtype)
    rng = np.random.default_rng(4)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (weights.size // block_weights, block_bytes), dtype=np.uint8)
    at = (slice(208, 210),) if qtype == Q.Q6_K else (slice(0, 2), slice(2, 4))
    for cut in at:
        blocks[:, cut] = rng.standard_normal((len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(weights.shape[0], -1)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("chunk", [None, 96])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K,
                                   Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_torch_dequantizes_to_the_same_bits_as_the_gguf_package(qtype, chunk, device,
                                                                monkeypatch):
    """Every type torch unpacks, whole and in chunks that end inside the tensor, on the CPU
    and (where there is one) on the GPU."""
    from ppqa.engine.loading import gguf_quants

    if chunk is not None:  # 96 weights: one block of 32 short of a chunk's end at 128
        monkeypatch.setattr(gguf_quants, "CPU_CHUNK_WEIGHTS", chunk)
        monkeypatch.setattr(gguf_quants, "DEVICE_CHUNK_WEIGHTS", chunk)
    rng = np.random.default_rng(3)
    weights = (rng.standard_normal((48, 512)) * np.exp(rng.standard_normal((48, 1)))).astype(np.float32)
    weights[0, :32] = 0.0  # a block of zeros: scale 0
    data = _blocks_of(qtype, weights)
    got = gguf_quants.dequantize(data, qtype, weights.shape, torch.device(device))
    want = gguf.quants.dequantize(data, qtype).reshape(weights.shape)
    assert got.dtype == torch.float32 and got.shape == weights.shape
    assert got.device.type == device
    assert np.array_equal(got.cpu().numpy().view(np.uint32),
                          want.astype(np.float32).view(np.uint32))


def test_other_types_are_left_to_the_gguf_package():
    from ppqa.engine.loading import gguf_quants

    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q2_K][1]
    assert gguf_quants.dequantize(np.zeros(block_bytes, np.uint8), Q.Q2_K, (256,),
                                  torch.device("cpu")) is None


# Every type torch unpacks, and Q5_0, which stays with gguf's numpy code.
STREAMED = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0]


def write_blocks_gguf(path: Path, qtype) -> Path:
    """A Llama GGUF's tensors in `qtype` (`_blocks_of`), rows of 512 weights (whole k-quant
    blocks), q/k rows permuted as llama.cpp stores them; F32 norms and rope_freqs (not loaded)
    between them, as llama.cpp writes its files. No tokenizer: `_weights` reads tensors only."""
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("rope_freqs.weight", np.linspace(1, 8, 8, dtype=np.float32))
    for name, rows, heads, norm in [
            ("blk.0.attn_q.weight", HEADS * HEAD_DIM, HEADS, "blk.0.attn_norm.weight"),
            ("blk.0.attn_k.weight", KV_HEADS * HEAD_DIM, KV_HEADS, "blk.0.ffn_norm.weight"),
            ("blk.0.ffn_up.weight", 3, None, "output_norm.weight")]:
        weights = rng.standard_normal((rows, 512)).astype(np.float32)
        if heads is not None:
            weights = _llama_cpp_permute(weights, heads)
        w.add_tensor(name, _blocks_of(qtype, weights), raw_dtype=qtype)
        w.add_tensor(norm, rng.standard_normal(512).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def blocks_config():
    """The config `_weights` needs for a `write_blocks_gguf` file: q/k heads."""
    from ppqa.engine.model.config import ModelConfig

    return ModelConfig(vocab_size=8, hidden_size=512, intermediate_size=3, num_layers=1,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.mark.parametrize("unpack_chunk", [None, 96])
@pytest.mark.parametrize("qtype", STREAMED, ids=lambda q: q.name)
def test_byte_runs_unpack_to_the_memory_mapped_bits(tmp_path, qtype, unpack_chunk, monkeypatch):
    """Each tensor read as a byte run (`stream_runs`, on the CPU, in reads of 100 bytes that
    end inside tensors and blocks) and unpacked from those bytes is, bit for bit, the tensor
    read from the memory map, after the same unpermutation and cast; the F32 norms between
    them stream too, beside Q5_0's tensors, which are not streamed."""
    from ppqa.engine.loading import gguf_quants
    from ppqa.engine.loading.gguf import _weights

    if unpack_chunk is not None:  # unpack from slices that begin inside the run
        monkeypatch.setattr(gguf_quants, "CPU_CHUNK_WEIGHTS", unpack_chunk)
    path = write_blocks_gguf(tmp_path / f"blocks-{qtype.name}.gguf", qtype)
    cpu = torch.device("cpu")
    mapped = list(_weights(path, blocks_config(), "llama", cpu, torch.float32, streamed=False))
    streamed = list(_weights(path, blocks_config(), "llama", cpu, torch.float32, streamed=True,
                             chunk_bytes=100))
    assert [name for name, _ in streamed] == [name for name, _ in mapped]
    assert len(mapped) == 6 and "rope" not in " ".join(name for name, _ in mapped)
    for (name, got), (_, want) in zip(streamed, mapped):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_a_file_cut_short_while_streamed_names_the_tensor(tmp_path):
    """The streamed reads go to the file, not to its memory map: a file truncated after the
    first tensor arrived fails a later read with a ModelLoadError that names its tensor."""
    from ppqa.engine.loading.gguf import _weights

    path = write_blocks_gguf(tmp_path / "cut.gguf", Q.Q8_0)
    weights = _weights(path, blocks_config(), "llama", torch.device("cpu"), torch.float32,
                       streamed=True, chunk_bytes=100)
    next(weights)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=r"cannot read tensor blk\.0\..*end of file"):
        list(weights)
