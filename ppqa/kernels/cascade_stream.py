"""The cascade document part dealt evenly over the whole GPU (stream-K), for contiguous
documents in a decode step.

`cascade.launch_shared_prefix` cuts every document of a step into the same number of
splits, planned on the host from the step's maxima; a CUDA graph plans them for its bound, so
a step with fewer documents than its bound leaves SMs idle (17 documents under a bound of 32
run 68 CTAs on 132 SMs). Here the grid is fixed at about as many CTAs as the GPU holds at once,
each KV head an equal share: a CTA reads the step's groups (request counts, document lengths,
the `CascadeMetadata` tensors) on the device, lays out its head's work as a list of 64-key
tiles over every (document, query tile) item, and takes an equal run of it, writing one partial
state per item its run touches (the item's state index is the CTA's distance from the item's
first CTA); the item's last CTA marks the item's unused states empty, which `merge_partials`
skips. CTAs next to each other in the grid take the same run of different heads, so they read
neighbouring bytes of the same slots together, as the split grid's do. The backend chooses
between the two (`triton_backend.STREAM_BELOW_FILL`): this kernel gains where the split plan
under-fills the GPU and loses a few percent where it fills whole waves
(benchmarks/RESULTS.md, "Cascade's document part dealt over every SM").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys
from ppqa.kernels._tile import NEG_BIG, write_rows
from ppqa.kernels.cascade import contig_run, tiling
from ppqa.kernels.merge import PartialScratch, partial_strides

# The stream kernel reads every group's counts as one vector of at least this many (fewer
# widths, fewer compiled variants; a step's groups are padded to a power of two).
STREAM_GROUP_BLOCK = 32


# Counts and offsets are not specialised on (== 1, a multiple of 16): each such class of values
# would be one more variant to compile.
@triton.jit(do_not_specialize=["state_offset", "num_states", "num_groups", "num_kv_heads",
                               "head_ctas", "min_chunk", "stride_plt", "stride_plh"])
def _prefix_stream_kernel(
    Q, Part_o, Part_lse,
    K_pool, V_pool, K_desc, V_desc, Group_indptr, Doc_lens, Doc_starts,
    scale_log2, state_offset, num_states, num_groups, num_kv_heads, head_ctas, min_chunk,
    stride_qt, stride_qh,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
    stride_pool_s, stride_pool_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    kvh = tl.program_id(0) % num_kv_heads
    pid = tl.program_id(0) // num_kv_heads  # the CTA's place among its head's head_ctas
    REQS: tl.constexpr = BLOCK_M // GROUP  # requests per query tile

    # A head's work list, from the groups: a group with requests has a query tile's item of
    # (its key tiles, at least one: an empty document still writes its empty states) units.
    gi = tl.arange(0, BLOCK_G)
    g_ok = gi < num_groups
    req_lo = tl.load(Group_indptr + gi, mask=g_ok, other=0)
    n_req = tl.load(Group_indptr + gi + 1, mask=g_ok, other=0) - req_lo
    lens = tl.load(Doc_lens + gi, mask=g_ok, other=0)
    key_tiles = tl.where(n_req > 0, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)
    q_tiles = tl.cdiv(n_req, REQS)
    work = key_tiles * q_tiles
    ends = tl.cumsum(work, 0)
    total = tl.sum(work, 0)
    # A run as long as an equal share, and long enough that no item meets more CTAs than it
    # has states (an item of L units meets at most (L - 2) // chunk + 2).
    chunk = tl.maximum(tl.cdiv(total, head_ctas), tl.cdiv(tl.max(key_tiles, 0), num_states - 1))
    chunk = tl.maximum(chunk, min_chunk)
    at = pid * chunk
    stop = tl.minimum(at + chunk, total)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    while at < stop:
        g = tl.sum((ends <= at).to(tl.int32), 0)
        this = gi == g
        units = tl.sum(tl.where(this, key_tiles, 0), 0)
        local = at - tl.sum(tl.where(this, ends - work, 0), 0)
        m_tile = local // units
        first = at - (local - m_tile * units)  # the item's first unit
        end = tl.minimum(stop, first + units)

        r0 = tl.sum(tl.where(this, req_lo, 0), 0)
        local_req = m_tile * REQS + r // GROUP
        head = kvh * GROUP + r % GROUP
        row_ok = (r < REQS * GROUP) & (local_req < tl.sum(tl.where(this, n_req, 0), 0))
        tok = r0 + local_req
        q = tl.load(Q + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)
        doc_len = tl.sum(tl.where(this, lens, 0), 0)
        lo = (at - first) * BLOCK_N
        hi = tl.minimum((end - first) * BLOCK_N, doc_len)

        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        slot0 = tl.load(Doc_starts + g)
        if IDX64:
            slot0 = slot0.to(tl.int64)
        m_i, l_i, acc = contig_run(q, K_pool, V_pool, K_desc, V_desc, slot0, lo, hi, kvh,
                                    stride_pool_s, stride_pool_h, scale_log2, m_i, l_i, acc,
                                    HEAD_DIM, BLOCK_D, BLOCK_N, DOT_DT, P_DT, PREC, TMA)

        state = pid - first // chunk
        write_rows(
            acc, m_i, l_i, tok, head, row_ok, state_offset + state,
            Part_o, Part_lse, Part_o, Part_lse,
            0, 0, 0, 0,
            stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
            HEAD_DIM, BLOCK_D, True, False,
        )
        if end == first + units:  # the item's last CTA: its states past this one are empty
            lse_row = Part_lse + tok.to(tl.int64) * stride_plt + head * stride_plh + state_offset
            for empty in range(state + 1, num_states):
                tl.store(lse_row + empty, tl.full([BLOCK_M], float("-inf"), tl.float32),
                         mask=row_ok)
        at = end


def stream_ctas(device: torch.device, tiles: _arch.Tiles, num_kv_heads: int) -> int:
    """The stream-K grid's CTAs for each KV head: an equal share of as many CTAs of these tiles
    as the GPU holds at once (at least one)."""
    return max(1, _arch.num_sms(device) * _arch.resident_ctas(tiles) // num_kv_heads)


def stream_states(device: torch.device, dtype: torch.dtype, batch: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, least_groups: int, max_group_size: int,
                  scratch: PartialScratch | None = None, reserved_states: int = 0) -> int:
    """Partial states per row for `launch_stream_prefix`, host-side: enough that a step of
    `least_groups` documents or more keeps every CTA of the grid busy (each of the fewest
    documents' items then meets about a head's CTAs / documents of them, one state each),
    within the scratch; 0 where the scratch cannot hold the two states the kernel needs (use
    the split kernel)."""
    tiles, _, _ = tiling(device, dtype, num_heads // num_kv_heads, max_group_size,
                         contiguous=True)
    cap = scratch.max_states(batch, num_heads, head_dim) if scratch else _arch.MAX_SPLITS
    cap = min(cap - reserved_states, _arch.MAX_SPLITS)
    ctas = stream_ctas(device, tiles, num_kv_heads)
    states = max(2, min(triton.cdiv(ctas, max(least_groups, 1)) + 1, cap))
    return states if states <= cap else 0


def launch_stream_prefix(
    q, k_pool, v_pool, group_req_indptr, doc_lens, doc_starts, max_group_size: int,
    sm_scale: float, num_states: int, part_o, part_lse, state_offset: int = 0,
    tiles: _arch.Tiles | None = None, tma: bool | None = None, ctas: int | None = None,
) -> None:
    """The document part of contiguous documents, dealt evenly over `ctas` CTAs for each KV
    head (None: `stream_ctas`): partial states into part_o[:, :, state_offset : +num_states]
    (>= 2), every state written (those an item does not use as empty). doc_starts as
    launch_shared_prefix's; the groups, their requests and documents are read on the device
    only, so a graph captured for a bound serves every step within it."""
    if num_states < 2:
        raise ValueError(f"the stream kernel needs at least 2 states a row, got {num_states}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    tiles, block_m, _ = tiling(q.device, q.dtype, group, max_group_size, tiles, True)
    num_groups = doc_lens.shape[0]
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k_pool.dtype, q.device)
    descs = _arch.kv_descriptors(k_pool, v_pool, tiles.block_n, tma)
    ctas = ctas or stream_ctas(q.device, tiles, num_kv_heads)
    _prefix_stream_kernel[(ctas * num_kv_heads,)](
        q, part_o, part_lse,
        k_pool, v_pool, *(descs or (k_pool, v_pool)), group_req_indptr, doc_lens, doc_starts,
        sm_scale * math.log2(math.e), state_offset, num_states, num_groups, num_kv_heads, ctas,
        triton.cdiv(_arch.MIN_SPLIT_TOKENS, tiles.block_n),
        q.stride(0), q.stride(1), *partial_strides(part_o, part_lse, True),
        k_pool.stride(0), k_pool.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_G=max(STREAM_GROUP_BLOCK, triton.next_power_of_2(num_groups)),
        DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=_arch.needs_int64(k_pool),
        TMA=descs is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
