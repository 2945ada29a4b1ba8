"""The split planners in ppqa/kernels/_arch.py: how many pieces the attention kernels cut each KV
row into, from the launch's program count, its longest row and the device's SM count. Host
arithmetic, checked for what each planner promises over a range of shapes and SM counts (the
interpreter's 4 and GPU-sized ones; `num_sms` and `is_gpu` are patched to stand for a GPU).

Every planner: at least 1 and at most its cap (split_cap, MAX_SPLITS); never more pieces than
MIN_SPLIT_TOKENS-key pieces would need (splits <= ceil(max_keys / MIN_SPLIT_TOKENS): the kernels
cut a row into ceil(len / splits) keys rounded up to whole tiles); non-decreasing in the row's
length, so a CUDA graph captured at a bucket's bound plans for every row under it.
- choose_splits: the fewest pieces that reach two waves (2 x SMs programs), unless a bound stops
  it first; one piece once the programs alone fill two waves.
- decode_row_splits (stock decode): choose_splits' count or more, and on a GPU pieces of at most
  DECODE_PIECE_KEYS keys unless the cap stops it.
- wave_splits (contiguous documents): the fewest pieces that fill the last wave of
  SMs x ctas_per_sm slots to WAVE_FILL; when none does, the best fill (fewest pieces on a tie).
"""

import itertools
import math

import pytest
import torch

from ppqa.kernels import _arch

CPU = torch.device("cpu")
SMS = (4, 108, 132)
PROGRAMS = (1, 2, 3, 7, 32, 60, 64, 100, 132, 140, 264, 1000, 8192)
KEYS = (1, 100, 256, 257, 600, 1024, 4000, 4097, 8192 + 146, 16384 + 146, 70_000)
CAPS = (1, 3, _arch.MAX_SPLITS)


@pytest.fixture(params=SMS, ids=lambda n: f"{n}sms")
def sms(request, monkeypatch) -> int:
    monkeypatch.setattr(_arch, "num_sms", lambda device: request.param)
    return request.param


@pytest.fixture
def on_gpu(monkeypatch) -> None:
    monkeypatch.setattr(_arch, "is_gpu", lambda device: True)


def fill(launched: int, slots: int) -> float:
    return launched / (math.ceil(launched / slots) * slots)


def shapes():
    return itertools.product(PROGRAMS, KEYS, CAPS)


def assert_common_bounds(splits: int, keys: int, cap: int) -> None:
    assert 1 <= splits <= min(cap, _arch.MAX_SPLITS)
    assert splits <= max(1, math.ceil(keys / _arch.MIN_SPLIT_TOKENS))


def assert_grows_with_the_row(plan) -> None:
    for programs, cap in itertools.product(PROGRAMS, CAPS):
        counts = [plan(programs, keys, cap) for keys in range(1, 40_000, 97)]
        assert counts == sorted(counts), (programs, cap)


def test_choose_splits_reaches_two_waves_with_the_fewest_pieces(sms):
    target = 2 * sms
    for programs, keys, cap in shapes():
        splits = _arch.choose_splits(programs, keys, CPU, cap)
        assert_common_bounds(splits, keys, cap)
        if programs >= target or keys <= _arch.MIN_SPLIT_TOKENS:
            assert splits == 1
            continue
        bound = min(cap, _arch.MAX_SPLITS, math.ceil(keys / _arch.MIN_SPLIT_TOKENS))
        assert programs * splits >= target or splits == bound, (programs, keys, cap)
        assert programs * (splits - 1) < target  # no piece more than two waves need
    assert_grows_with_the_row(lambda p, k, c: _arch.choose_splits(p, k, CPU, c))


def test_stock_decode_rows_are_cut_into_bounded_pieces_on_a_gpu(sms, on_gpu):
    for programs, keys, cap in shapes():
        splits = _arch.decode_row_splits(programs, keys, CPU, cap)
        assert_common_bounds(splits, keys, cap)
        assert splits >= _arch.choose_splits(programs, keys, CPU, cap)
        piece = math.ceil(keys / splits)
        assert piece <= _arch.DECODE_PIECE_KEYS or splits == min(cap, _arch.MAX_SPLITS)
    assert_grows_with_the_row(lambda p, k, c: _arch.decode_row_splits(p, k, CPU, c))


def test_stock_decode_rows_follow_choose_splits_under_the_interpreter(sms):
    for programs, keys, cap in shapes():
        assert (_arch.decode_row_splits(programs, keys, CPU, cap)
                == _arch.choose_splits(programs, keys, CPU, cap))


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_wave_splits_take_the_fewest_pieces_that_fill_the_last_wave(sms, ctas_per_sm):
    slots = sms * ctas_per_sm
    for programs, keys, cap in shapes():
        splits = _arch.wave_splits(programs, keys, CPU, cap, ctas_per_sm)
        assert_common_bounds(splits, keys, cap)
        allowed = range(1, min(cap, _arch.MAX_SPLITS, max(1, math.ceil(keys / _arch.MIN_SPLIT_TOKENS))) + 1)
        fills = {s: fill(programs * s, slots) for s in allowed}
        full = [s for s in allowed if fills[s] >= _arch.WAVE_FILL]
        if full:
            assert splits == full[0], (programs, keys, cap)
        else:
            best = max(fills.values())
            assert fills[splits] == best and splits == min(s for s in allowed if fills[s] == best)
    assert_grows_with_the_row(lambda p, k, c: _arch.wave_splits(p, k, CPU, c, ctas_per_sm))


def test_the_decode_launcher_plans_per_kv_head_and_honours_the_scratch_cap(sms, on_gpu):
    from ppqa.kernels.decode_attention import decode_splits

    for batch, (heads, kv_heads, dim), keys in itertools.product(
            (1, 2, 64, 256), ((32, 32, 128), (28, 4, 128)), (4000, 16384 + 146)):
        programs = batch * kv_heads
        assert (decode_splits(CPU, batch, heads, kv_heads, dim, keys)
                == _arch.decode_row_splits(programs, keys, CPU))
        # the cascade suffix reads only the row's tail: the fill rule alone
        assert (decode_splits(CPU, batch, heads, kv_heads, dim, keys, whole_rows=False)
                == _arch.choose_splits(programs, keys, CPU))


def test_contiguous_kernels_plan_whole_waves_and_others_two_waves(sms):
    wide, narrow = _arch.Tiles(128, 64, 8, 3), _arch.Tiles(64, 64, 4, 3)
    assert (_arch.resident_ctas(wide), _arch.resident_ctas(narrow)) == (1, 2)
    for programs, keys, cap in shapes():
        for tiles in (wide, narrow):
            assert (_arch.row_splits(programs, keys, CPU, cap, tiles, contiguous=True)
                    == _arch.wave_splits(programs, keys, CPU, cap, _arch.resident_ctas(tiles)))
            assert (_arch.row_splits(programs, keys, CPU, cap, tiles, contiguous=False)
                    == _arch.choose_splits(programs, keys, CPU, cap))
