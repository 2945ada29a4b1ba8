"""Compile every attention kernel variant for an H100/H200 (sm_90) on a machine without a GPU.

Catches what Triton's CPU interpreter lets through (it skips the compiler front end's checks)
and prints registers, spills and shared memory per variant, at no device time. It replaces
JITFunction.run so that the public launchers, called on CPU tensors at model shapes, hand their
arguments to `triton.compile(target=sm_90)` instead of launching. Needs the ptxas that the
triton wheel carries. Each line also says whether the K/V loops' loads became async copies
(`async N`: cp.async ops in the TTGIR). Usage: python benchmarks/compile_check.py [--sweep]
(--sweep: also the contiguous-document tile configs that benchmarks/layer_kernels.py sweeps).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
TARGET = GPUTarget("cuda", 90, 32)
seen: dict[tuple, str] = {}


def _resources(cubin: bytes) -> str:
    """Registers, stack (spills land there) and shared memory, from cuobjdump -res-usage."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return " ".join(f"{k.lower()} {found.get(k, '?'):>5}" for k in ("REG", "STACK", "SHARED"))


def _compile(self, *args, grid, warmup, **kwargs):
    # Triton's own argument binder, so that the compile sees what a launch would: 16-byte
    # aligned pointers and ints divisible by 16 marked tt.divisibility (without that hint no
    # load is vectorised and none becomes a cp.async copy), ints equal to 1 as constants.
    backend = make_backend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                            specialization, options)
    names = {self.arg_names[path[0]]: value for path, value in constexprs.items()}
    shown = {k: str(v) for k, v in names.items() if k.isupper() and k != "HEAD_DIM"}
    # runtime ints that equal 1 (num_splits, num_m_tiles, ...) are compiled in as constants:
    # a different variant, often with fewer registers
    ones = sorted(k for k in names if not k.isupper())
    if ones:
        shown["ones"] = ",".join(ones)
    launch = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    key = (self.fn.__name__, tuple(sorted(shown.items())), tuple(sorted(launch.items())))
    if key in seen:
        return None
    compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    ttgir = compiled.asm["ttgir"]
    dump = os.environ.get("DUMP_TTGIR")
    if dump and dump in self.fn.__name__:
        print(ttgir)
    seen[key] = (f"{self.fn.__name__:15} {_resources(compiled.asm['cubin'])} "
                 f"dyn-smem {compiled.metadata.shared:6} "
                 f"async {ttgir.count('ttg.async_copy_global_to_local'):2} {launch} {shown}")
    print(seen[key], flush=True)
    return None


def _sweep_configs(kernel: str, wanted: bool) -> list[tuple]:
    """The tile configs benchmarks/layer_kernels.py --sweep-<kernel> times (contiguous variants)."""
    if not wanted:
        return []
    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_sweeps import CONTIG_SWEEP
    return CONTIG_SWEEP[kernel]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true",
                        help="also compile the contiguous-document sweep configs of layer_kernels.py")
    sweep = parser.parse_args().sweep
    print(f"triton {triton.__version__} (the H200 results used 3.6.0: to match, put that wheel "
          "first on PYTHONPATH)")
    JITFunction.run = _compile
    from ppqa.kernels.cascade import shared_prefix_attention
    from ppqa.kernels.cascade_stream import launch_stream_prefix
    from ppqa.kernels.decode_attention import decode_attention
    from ppqa.kernels.extend_attention import extend_attention
    from ppqa.kernels.kv_store import store_kv
    from ppqa.kernels._arch import Tiles

    # Pretend CPU tensors live on an H200, for tile, split and dtype choices.
    from ppqa.kernels import _arch
    _arch.num_sms = lambda device: 132
    _arch._capability = lambda device: (9, 0)
    _arch.is_gpu = lambda device: True

    i32 = dict(dtype=torch.int32)
    # CHECK=bf16 (or fp16/fp32, and/or mha/gqa) narrows the variants while tuning.
    want = os.environ.get("CHECK", "bf16,fp16,fp32,mha,gqa")
    heads = [h for h, name in (((32, 32), "mha"), ((28, 4), "gqa")) if name in want] or \
        [(32, 32), (28, 4)]
    dtypes = [d for d, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                (torch.float32, "fp32")) if name in want] or [torch.bfloat16]
    for hq, hkv in heads:
        for dtype in dtypes:
            q = torch.zeros(64, hq, 128, dtype=dtype)
            kv = torch.zeros(64, hkv, 128, dtype=dtype)
            pool = torch.zeros(16, hkv, 128, dtype=dtype)
            table = torch.zeros(4, 8, **i32)
            b = torch.zeros(4, **i32)
            for ext, splits, doc in ((1, 1, False), (16, 4, False), (64, 1, False),
                                     (128, 1, False), (32, 1, True), (32, 2, True),
                                     (128, 1, True)):
                lse = torch.zeros(64, hq)
                extend_attention(q, kv, kv, q, pool, pool, table, b, b, b,
                                 torch.zeros(5, **i32), torch.zeros(64, **i32),
                                 torch.zeros(16, **i32), ext, 0.1, lse=lse, num_splits=splits,
                                 **(dict(doc_start=b, doc_len=b) if doc else {}))
            for splits, doc, tma in ((1, False, None), (4, False, None), (1, True, None),
                                     (4, True, None), (4, True, False)):
                rows = torch.zeros(64, **i32)
                decode_attention(q, q, pool, pool, table, rows, rows, rows, 0.1,
                                 num_splits=splits, tma=tma,
                                 **(dict(doc_start=rows, doc_len=rows) if doc else {}))
            group = (torch.zeros(2, **i32), torch.zeros(1, **i32), torch.zeros(1, **i32))
            shared_prefix_attention(q, q, torch.zeros(64, hq), pool, pool, table, *group, 64,
                                    1024, 0.1, num_splits=4)
            sweep_dtype = sweep and dtype != torch.float32
            for size, contig_tiles in ((256, None), (8, None),
                                       *((256, t) for t in _sweep_configs("prefix", sweep_dtype))):
                options = contig_tiles[4] if contig_tiles and len(contig_tiles) > 4 else {}
                shared_prefix_attention(q, q, torch.zeros(64, hq), pool, pool, table, *group,
                                        size, 16384, 0.1, num_splits=2, doc_starts=group[1],
                                        tiles=Tiles(*contig_tiles[:4]) if contig_tiles else None,
                                        **options)
            for size in (256, 8):  # the stream-K form, with TMA
                launch_stream_prefix(q, pool, pool, group[0], group[2], group[1], size, 0.1, 2,
                                     torch.zeros(64, hq, 2, 128), torch.zeros(64, hq, 2))
            for size in (256, 8):  # the pointer-load variant (TMA is the sm_90 default)
                shared_prefix_attention(q, q, torch.zeros(64, hq), pool, pool, table, *group,
                                        size, 16384, 0.1, num_splits=2, doc_starts=group[1],
                                        tma=False)
            for ext_tiles in _sweep_configs("extend", sweep_dtype):
                extend_attention(q, kv, kv, q, pool, pool, table, b, b, b,
                                 torch.zeros(5, **i32), torch.zeros(64, **i32),
                                 torch.zeros(16, **i32), 32, 0.1, num_splits=2,
                                 doc_start=b, doc_len=b, tiles=Tiles(*ext_tiles[:4]),
                                 **(ext_tiles[4] if len(ext_tiles) > 4 else {}))
            store_kv(pool, pool, torch.zeros(64, dtype=torch.int64), kv, kv)
    print(f"{len(seen)} variants compiled for sm_90")


if __name__ == "__main__":
    main()
