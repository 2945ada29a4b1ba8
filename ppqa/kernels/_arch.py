"""Per-device choices for the attention kernels: SM count, tile shapes, split counts.

The launchers in this package ask here for their tile sizes and for how many pieces to split a
KV row into; nothing else in the package reads device properties. On a CPU tensor the kernels run
under Triton's interpreter (TRITON_INTERPRET=1), where each program is numpy code: there we pick
small query tiles but long key tiles (fewer loop iterations is what makes the interpreter fast)
and pretend to have a few SMs so that the split paths are exercised by the CPU tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETER_SMS = 4  # small, so the CPU tests split rows the way a GPU would at large sizes
MIN_SPLIT_TOKENS = 256  # a split must read at least this many keys to pay for its reduction
MAX_SPLITS = 64
DECODE_PIECE_KEYS = 4096  # decode_row_splits: the longest piece of a stock decode row
WAVE_FILL = 0.9  # wave_splits: the share of the last wave's SM slots that must hold a program


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows of a tile (tokens x grouped heads)
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two, got {value}")


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> tuple[int, int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major, props.minor


def is_gpu(device: torch.device) -> bool:
    """Whether launches on `device` compile for a GPU (else: Triton's CPU interpreter).
    benchmarks/compile_check.py replaces this to compile GPU variants on a CPU machine."""
    return device.type == "cuda"


def num_sms(device: torch.device) -> int:
    if not is_gpu(device):
        return INTERPRETER_SMS
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())[0]


def _capability(device: torch.device) -> tuple[int, int]:
    if not is_gpu(device):
        return (0, 0)
    _, major, minor = _cuda_props(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return major, minor


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products: tf32 noise could flip greedy tokens between modes."""
    return "ieee" if dtype == torch.float32 else "tf32"


def extend_tiles(device: torch.device, dtype: torch.dtype, rows: int,
                 contiguous: bool = False) -> Tiles:
    """Tiles for the extend kernel; `rows` = query rows one request needs (tokens x group);
    contiguous: the launch passes doc_start/doc_len (the document read by cp.async copies).

    Contiguous documents, sm_90, bf16/fp16: 64 x 64, 4 warps, 3 stages (two CTAs an SM), for
    decode steps and prefills alike, the fastest of the tiles swept (kernels.py --sweep-extend
    and --sweep-prefill) on MHA and GQA: parallel's decode step at P=32, 16k/256 takes 0.44 /
    0.30 ms a layer under TMA, its question prefill runs at 508 TFLOP/s against 170 for
    64 x 64 x 8 warps x 2 stages (benchmarks/RESULTS.md, 'TMA against pointer loads' and
    'Parallel's question prefill tile').
    It takes 252-254 registers (MHA) with no spills while one query tile holds the request
    (P <= 64); a second tile (question prefill chunks) spills 48 bytes outside the key loops.
    Gathered rows (no document hints): decode steps take 16-32 query rows x 64 keys x 8 warps
    x 2 stages, since the two-stage kernel spills past that (compile_check.py); prefills
    (many rows, compute-bound) take 64 x 64. fp32 (exact "ieee" dots, tests only) uses the
    smallest tiles that compile without spills.
    """
    want_m = max(16, triton.next_power_of_2(max(rows, 1)))
    if not is_gpu(device):
        return Tiles(min(want_m, 128), 128, 4, 1)
    if dtype == torch.float32:
        return Tiles(16, 32, 4, 2)
    if contiguous:
        return Tiles(64, 64, 4, 3)
    if rows > 512:
        return Tiles(64, 64, 8, 2)
    return Tiles(min(want_m, 32), 64, 8, 2)


def decode_tiles(device: torch.device, dtype: torch.dtype, group: int) -> Tiles:
    """Tiles for the paged decode kernel: block_m holds one KV head's query heads.

    On a GPU even MHA (one query row) takes the tl.dot path with 16 rows: the multiply-and-sum
    version reduces across warps every key tile and reads without L2 reuse (17.9 ms a layer at
    16k/256 on CodeLlama, 3.9 TB/s of requested bytes). The interpreter keeps the one-row path
    tested too.
    bf16/fp16 on sm_90: one warp x 32 keys x 3 stages, the fastest of the tiles swept at 16k/256
    and 8k/64 on both models (kernels.py --sweep-decode; benchmarks/RESULTS.md, 'TMA against
    pointer loads'): the read is L2-bound (the requests share the document's lines), and many
    small CTAs keep more independent loads in flight than a few wide ones.
    """
    if not is_gpu(device):
        return Tiles(1 if group == 1 else max(16, triton.next_power_of_2(group)), 128, 4, 1)
    block_m = max(16, triton.next_power_of_2(group))
    if dtype == torch.float32:
        return Tiles(block_m, 32, 4, 2)
    return Tiles(block_m, 32, 1, 3)


def use_tma(device: torch.device) -> bool:
    """Whether the decode, prefix and extend kernels read a contiguous document's whole tiles
    through tensor descriptors (the tensor memory accelerator, sm_90 and later) by default;
    elsewhere, and under the interpreter, pointer loads (tests force both paths).

    One 2-D copy per K or V tile replaces 32 to 64 row copies, and the loop keeps no address
    registers: on the H200 stock decode is 8-26% faster and parallel's extend ~15%
    (benchmarks/RESULTS.md, 'TMA against pointer loads'), cascade's document product too
    ('Cascade's decode step').
    """
    return is_gpu(device) and _capability(device) >= (9, 0)


def kv_descriptors(k_pool: torch.Tensor, v_pool: torch.Tensor, block_n: int,
                   tma: bool | None = None):
    """Tensor descriptors of K and V [slots, heads, head_dim] viewed as [slots, heads x
    head_dim], a block being block_n slots x one head, for a launcher's `tma` (None:
    `use_tma`): the KV pools, or views with a row stride of their own (K and V split from a
    packed qkv). None when tma is off or a tensor cannot take one (a head_dim that is not a
    power of two, heads not contiguous within a row, K and V of other shapes or strides, or
    a base or row not 16-byte aligned)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not (tma if tma is not None else use_tma(k_pool.device)):
        return None

    slots, heads, head_dim = k_pool.shape
    row_stride = k_pool.stride(0)
    for pool in (k_pool, v_pool):
        if (pool.shape != k_pool.shape or pool.stride() != (row_stride, head_dim, 1)
                or pool.data_ptr() % 16 or (row_stride * pool.element_size()) % 16):
            return None
    if head_dim & (head_dim - 1) or head_dim * k_pool.element_size() < 16:
        return None
    return tuple(TensorDescriptor.from_tensor(
        pool.as_strided((slots, heads * head_dim), (row_stride, 1)), [block_n, head_dim])
        for pool in (k_pool, v_pool))


def prefix_tiles(device: torch.device, dtype: torch.dtype, rows: int) -> Tiles:
    """Tiles for the shared-prefix (cascade) kernel over gathered documents (req_to_token):
    64 query rows x 32 keys x 4 warps x 2 stages, faster at 16k/256 on both models than
    64 x 64 x 4 warps and 128 x 64 x 8 warps (H200: 0.25 against 0.31 and 0.35 ms a layer)."""
    want_m = max(16, triton.next_power_of_2(max(rows, 1)))
    if not is_gpu(device):
        return Tiles(min(want_m, 128), 128, 4, 1)
    if dtype == torch.float32:
        return Tiles(16, 32, 4, 2)
    return Tiles(min(want_m, 64), 32, 4, 2)


def contig_prefix_tiles(device: torch.device, dtype: torch.dtype, rows: int) -> Tiles:
    """Tiles for the shared-prefix kernel when the document's slots are one run (doc_starts
    given): a FlashAttention-style forward whose K/V addresses are affine in the loop index, so
    Triton's pipeliner turns the loads into cp.async copies num_stages - 1 tiles ahead.

    sm_90, bf16/fp16: 128 query rows x 64 keys, 8 warps (two warpgroups of 64 rows, each on
    wgmma), 3 stages: the Hopper forward config of Triton's fused-attention tutorial. With
    triton 3.6 (compile_check.py): 140 registers MHA / 168 GQA, no spills, 128 KiB of shared
    memory (Q + 3 K/V stages), so one CTA per SM, which `wave_splits` is told. A group of <= 64
    rows takes 64 rows x 4 warps (164 / 180 registers, 112 KiB) rather than computing padding.
    H200 (benchmarks/kernels.py --sweep-prefix, 16k/256, merge included, CUDA graph replays):
    0.167 ms CodeLlama, 0.163 Qwen2.5 at the planned 2 splits (gather 0.255 / 0.236; SDPA's
    shared read 0.196), the best of the six tiles swept; 2 stages instead of 3: 0.26 / 0.24.
    fp32 (exact "ieee" dots, tests only): 32 x 32 x 8 warps, 80 registers (16 x 32 x 4 warps,
    the gather kernel's fp32 tile, spills ~300 bytes).
    """
    want_m = max(16, triton.next_power_of_2(max(rows, 1)))
    if not is_gpu(device):
        return Tiles(min(want_m, 128), 128, 4, 1)
    if dtype == torch.float32:
        return Tiles(32, 32, 8, 2)
    if rows <= 64:
        return Tiles(64, 64, 4, 3)
    return Tiles(128, 64, 8, 3)


def choose_splits(
    programs: int, max_keys: int, device: torch.device, split_cap: int = MAX_SPLITS
) -> int:
    """How many pieces to cut each KV row into so `programs` x pieces fills the GPU.

    Host-side, from the batch shape and the longest row only, so a CUDA graph captured with an
    upper bound on the row length keeps its grid. Each piece reads >= MIN_SPLIT_TOKENS keys.
    """
    target = 2 * num_sms(device)  # two waves of programs hide the tail of the slowest one
    if programs >= target or max_keys <= MIN_SPLIT_TOKENS:
        return 1
    splits = triton.cdiv(target, max(programs, 1))
    splits = min(splits, triton.cdiv(max_keys, MIN_SPLIT_TOKENS), split_cap, MAX_SPLITS)
    return max(1, splits)


def decode_row_splits(programs: int, max_keys: int, device: torch.device,
                      split_cap: int = MAX_SPLITS) -> int:
    """Splits of a stock decode row: choose_splits' fill, and pieces of at most
    DECODE_PIECE_KEYS keys even when the requests alone fill the GPU: shorter pieces shorten
    the last wave's tail (H200, one warp x 32 keys: 4-6 splits instead of 1 took CodeLlama
    16k/256 6.82 -> 6.59 ms a layer, Qwen2.5 1.02 -> 0.90, CodeLlama 8k/64 0.91 -> 0.88)."""
    fill = choose_splits(programs, max_keys, device, split_cap)
    if not is_gpu(device):
        return fill
    pieces = min(triton.cdiv(max_keys, DECODE_PIECE_KEYS), split_cap, MAX_SPLITS)
    return max(fill, pieces)


def wave_splits(
    programs: int, max_keys: int, device: torch.device, split_cap: int = MAX_SPLITS,
    ctas_per_sm: int = 1,
) -> int:
    """Fewest pieces to cut each KV row into so that `programs` x pieces fills whole waves of
    the GPU to at least WAVE_FILL; else the count with the best fill.

    For compute-bound kernels of equal work per program (the contiguous shared-prefix kernel):
    time ~ waves x work per program, so 64 programs on 132 SMs run best as 2 splits (one wave
    of 128), not as choose_splits' 5 (320 programs in 3 waves, 81% full). Fewer splits at equal
    fill: each split adds a float32 partial state per query row to write and merge. Host-side
    and from maxima only, like choose_splits; each piece reads >= MIN_SPLIT_TOKENS keys.
    H200, contiguous prefix, CodeLlama 16k/256: 1 / 2 / 4 / 8 splits 0.32 / 0.167 / 0.174 /
    0.187 ms (Qwen2.5 0.35 / 0.163 / 0.167 / 0.177); 3 or 5 splits (1.5 or 2.5 waves) ~0.21.
    """
    slots = num_sms(device) * ctas_per_sm
    most = max(1, min(split_cap, MAX_SPLITS, triton.cdiv(max_keys, MIN_SPLIT_TOKENS)))
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        launched = max(programs, 1) * splits
        fill = launched / (triton.cdiv(launched, slots) * slots)
        if fill >= WAVE_FILL:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


def resident_ctas(tiles: Tiles) -> int:
    """CTAs of a contiguous-document kernel that fit on one SM (wave_splits' ctas_per_sm), from
    compile_check.py on sm_90: the 8-warp tiles take > 128 registers a thread (one CTA), the
    4-warp ones 160-255 with <= 112 KiB of shared memory (two)."""
    return 1 if tiles.num_warps >= 8 else 2


def kernel_dtypes(dtype: torch.dtype, device: torch.device):
    """(DOT_DT, P_DT, PREC) constexprs for a pool dtype (see _tile.py on the interpreter's bf16)."""
    p_dt = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    dot_dt = tl.float32 if (not is_gpu(device) and dtype == torch.bfloat16) else p_dt
    return dot_dt, p_dt, dot_precision(dtype)


def needs_int64(pool: torch.Tensor) -> bool:
    """Whether element offsets into a pool buffer can pass 2^31 (then kernels index in int64;
    int32 offsets save registers, e.g. 255 -> 203 in the GQA decode kernel)."""
    return pool.numel() >= 2**31


def row_splits(programs: int, max_keys: int, device: torch.device, split_cap: int,
               tiles: Tiles, contiguous: bool) -> int:
    """The split count of a kernel reading KV rows: `wave_splits` for the contiguous-document
    variants (their tiles tell how many CTAs share an SM), else `choose_splits`."""
    if contiguous:
        return wave_splits(programs, max_keys, device, split_cap, resident_ctas(tiles))
    return choose_splits(programs, max_keys, device, split_cap)
