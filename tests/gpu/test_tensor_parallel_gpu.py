"""Tensor parallelism over NCCL on two GPUs: the CPU test's golden rule with CUDA graphs on.

dummy:tiny-gqa split over cuda:0 and cuda:1 (fp32, the Triton backend, decode steps captured as
CUDA graphs with their all-reduces and the logits' all-gather inside) gives the token ids of the
unsplit engine's stock mode on cuda:0, in every mode and after a cancel mid-run; dummy:tiny-odd
is refused. Skipped below two GPUs. The ranks are tests/tp_ranks.py's, as on the CPU.
"""

import pickle
import random

import pytest
import torch

from tests.helpers import answers_by_key, overlap_workload, plain_template
from tests.tp_ranks import ENGINE_CONFIG, MODES, cancelled, run_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_two_gpus_give_the_unsplit_stock_tokens(tmp_path):
    import torch.multiprocessing as mp

    from ppqa import Engine, EngineConfig
    from ppqa.engine.parallel.launch import free_port

    requests = overlap_workload(random.Random(23), plain_template(tmp_path))
    mp.spawn(run_rank, args=(2, free_port(), str(tmp_path), requests, True), nprocs=2, join=True)
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    one = Engine("dummy:tiny-gqa", device="cuda:0", dtype="float32",
                 config=EngineConfig(**ENGINE_CONFIG))
    reference = {k: ids for k, (ids, _, _) in answers_by_key(one, requests, mode="stock").items()}
    leader = ranks[0]
    assert leader["graphs"] is True and leader["captured"] > 0
    for mode, _ in MODES:
        assert leader[mode] == reference, mode
    kept = {r.key for r in requests if not cancelled(r.key)}
    assert {k: leader["after_cancel"][k] for k in kept} == {k: reference[k] for k in kept}
    assert [seen["kv_heads"] for seen in ranks] == [1, 1]
    assert all("3 attention heads" in seen["odd_refusal"] for seen in ranks)
