"""Tensor parallelism on the CPU: two gloo ranks give one rank's tokens, in every mode.

The golden rule at TP=2: dummy:tiny-gqa (6 heads, 2 KV heads) split over two processes answers a
workload of two documents (greedy and seeded sampled questions, a KV pool small enough that
requests wait) with exactly the token ids the unsplit engine gives in stock mode, in stock,
parallel, cascade and auto; a session that cancels questions mid-run keeps both ranks in step
(the follower repeats the cancel); each rank's KV pool holds its own KV head; and a model whose
heads do not divide (dummy:tiny-odd: 3 heads, 1 KV head) is refused with the reason. The
sharding itself is checked without processes: a rank's tensors are slices of the full ones.
"""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from tests.helpers import answers_by_key, overlap_workload, plain_template, tiny_engine
from tests.tp_ranks import ENGINE_CONFIG, MODES, cancelled, run_rank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The requests, the unsplit engine's stock answers, and what each of two ranks saw."""
    import torch.multiprocessing as mp

    from ppqa.engine.parallel.launch import free_port

    folder = tmp_path_factory.mktemp("tp")
    requests = overlap_workload(random.Random(23), plain_template(folder))
    mp.spawn(run_rank, args=(2, free_port(), str(folder), requests), nprocs=2, join=True)
    ranks = [pickle.loads((folder / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    reference = answers_by_key(tiny_engine("tiny-gqa", **ENGINE_CONFIG), requests, mode="stock")
    return requests, {k: ids for k, (ids, _, _) in reference.items()}, ranks


@pytest.mark.parametrize("mode", [m for m, _ in MODES])
def test_two_ranks_give_the_unsplit_stock_tokens(two_ranks, mode: str) -> None:
    requests, reference, ranks = two_ranks
    assert ranks[0][mode] == reference
    assert len({len(ids) for ids in reference.values()}) > 1  # streams end at different steps


def test_a_cancel_mid_run_keeps_the_ranks_in_step(two_ranks) -> None:
    requests, reference, ranks = two_ranks
    kept = {r.key for r in requests if not cancelled(r.key)}
    leader = ranks[0]
    assert leader["dropped"] > 0
    assert set(leader["after_cancel"]) <= {r.key for r in requests}
    assert kept <= set(leader["after_cancel"])  # every question not cancelled is answered ...
    assert {k: leader["after_cancel"][k] for k in kept} == {k: reference[k] for k in kept}
    assert ranks[1]["followed"] is True  # ... and the follower left when the leader shut down
    assert "call engine.follow()" in ranks[1]["session_refusal"]  # only rank 0 opens sessions
    assert "was shut down" in leader["after_shutdown"]  # and none once the followers left
    for seen in ranks:  # both ranks end with the same free KV and rows: the same decisions
        assert (seen["free_slots"], seen["free_rows"]) == (ranks[0]["free_slots"],
                                                           ranks[0]["free_rows"])


def test_each_rank_holds_its_own_kv_heads(two_ranks) -> None:
    *_, ranks = two_ranks
    assert [seen["kv_heads"] for seen in ranks] == [1, 1]  # tiny-gqa's 2 KV heads, one per rank
    assert ranks[0]["kv_slots"] == ranks[1]["kv_slots"] == ENGINE_CONFIG["kv_token_budget"] + 1


def test_heads_that_do_not_divide_are_refused(two_ranks) -> None:
    *_, ranks = two_ranks
    for seen in ranks:
        message = seen["odd_refusal"]
        assert "dummy:tiny-odd" in message and "3 attention heads" in message
        assert "1 KV heads" in message and "tensor_parallel 2" in message


def test_without_a_process_group_tensor_parallel_is_refused() -> None:
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        tiny_engine("tiny-gqa", tensor_parallel=2)


def test_a_rank_holds_slices_of_the_full_weights() -> None:
    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.parallel.tensor_parallel import TensorParallel, shard_weights

    full = dict(load_model("dummy:tiny-gqa", seed=5).weights)
    loaded = load_model("dummy:tiny-gqa", seed=5)
    config = loaded.config
    for rank in range(2):
        tp = TensorParallel(rank=rank, world=2)
        shard = dict(shard_weights(config, load_model("dummy:tiny-gqa", seed=5).weights, tp))
        qkv = "model.layers.1.self_attn.{}_proj.weight"
        torch.testing.assert_close(shard[qkv.format("q")],
                                   full[qkv.format("q")].chunk(2)[rank], rtol=0, atol=0)
        torch.testing.assert_close(shard[qkv.format("k")],  # one of the 2 KV heads (16 rows)
                                   full[qkv.format("k")][16 * rank:16 * rank + 16], rtol=0, atol=0)
        down = "model.layers.0.mlp.down_proj.weight"
        torch.testing.assert_close(shard[down], full[down][:, 100 * rank:100 * rank + 100],
                                   rtol=0, atol=0)
        head = shard["lm_head.weight"]
        torch.testing.assert_close(head, full["lm_head.weight"][192 * rank:192 * rank + 192],
                                   rtol=0, atol=0)
        assert shard["model.embed_tokens.weight"] is not None
        torch.testing.assert_close(shard["model.embed_tokens.weight"],
                                   full["model.embed_tokens.weight"], rtol=0, atol=0)


def test_the_70b_preset_splits_over_two_or_eight_ranks_but_not_three() -> None:
    from ppqa.engine.loading.presets import preset_config
    from ppqa.engine.parallel.tensor_parallel import check_divisible

    config, _, _ = preset_config("llama-3-70b")
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.vocab_size) == (80, 8192, 28672, 64, 8, 128256)
    assert config.rope_scaling == preset_config("llama-3-8b")[0].rope_scaling
    assert config.rope_theta == preset_config("llama-3-8b")[0].rope_theta
    for world in (1, 2, 8):
        check_divisible(config, world)
    with pytest.raises(ValueError, match="64 attention heads, 8 KV heads"):
        check_divisible(config, 3)
