"""Tensor parallelism through the Triton backend: two gloo ranks of dummy:tiny-gqa, each with 3
query heads over 1 KV head, give the unsplit torch backend's stock tokens in stock, parallel and
cascade, on the Triton kernels (under the interpreter on the CPU). On a GPU machine the two-GPU
test (tests/gpu/test_tensor_parallel_gpu.py) covers this over NCCL instead."""

import pickle

import pytest
from checks import ON_GPU

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig
from tests.tp_ranks import TRITON_DOCUMENT, TRITON_QUESTIONS, run_triton_rank


@pytest.mark.skipif(ON_GPU, reason="on a GPU, tests/gpu/test_tensor_parallel_gpu.py")
def test_two_ranks_on_the_triton_kernels_give_the_unsplit_tokens(tmp_path):
    import torch.multiprocessing as mp

    from ppqa.engine.parallel.launch import free_port

    mp.spawn(run_triton_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    leader = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert leader["backend"] == "triton"
    unsplit = Engine("dummy:tiny-gqa", device="cpu", dtype="float32",
                     config=EngineConfig(attention_backend="torch", kv_token_budget=4096))
    expected = [a.token_ids for a in unsplit.answer(
        TRITON_DOCUMENT, TRITON_QUESTIONS, mode="stock",
        sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))]
    assert len({tuple(t) for t in expected}) > 1
    for mode in ("stock", "parallel", "cascade"):
        assert leader[mode] == expected, mode
