"""Compile every attention kernel variant for an H100/H200 (sm_90) on a machine without a GPU.

Catches what Triton's CPU interpreter lets through (it skips the compiler front end's checks)
and prints registers, spills and shared memory per variant, at no device time. It replaces
JITFunction.run so that the public launchers, called on CPU tensors at model shapes, hand their
arguments to `triton.compile(target=sm_90)` instead of launching. Needs the ptxas that the
triton wheel carries. Usage: python benchmarks/compile_check.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}
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
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(self.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for p in self.params:
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    key = (self.fn.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())),
           tuple(sorted(options.items())))
    if key in seen:
        return None
    compiled = triton.compile(ASTSource(self, signature, constexprs), target=TARGET,
                              options=options)
    shown = {k: str(v) for k, v in constexprs.items() if k.isupper() and k != "HEAD_DIM"}
    dump = os.environ.get("DUMP_TTGIR")
    if dump and dump in self.fn.__name__:
        print(compiled.asm["ttgir"])
    seen[key] = (f"{self.fn.__name__:15} {_resources(compiled.asm['cubin'])} "
                 f"dyn-smem {compiled.metadata.shared:6} {options} {shown}")
    print(seen[key], flush=True)
    return None


def main() -> None:
    JITFunction.run = _compile
    from ppqa.kernels.cascade import shared_prefix_attention
    from ppqa.kernels.decode_attention import decode_attention
    from ppqa.kernels.extend_attention import extend_attention
    from ppqa.kernels.kv_store import store_kv

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
            for ext, splits in ((1, 1), (16, 4), (64, 1), (128, 1)):
                lse = torch.zeros(64, hq)
                extend_attention(q, kv, kv, q, pool, pool, table, b, b, b,
                                 torch.zeros(5, **i32), torch.zeros(64, **i32),
                                 torch.zeros(16, **i32), ext, 0.1, lse=lse, num_splits=splits)
            for splits in (1, 4):
                decode_attention(q, q, pool, pool, table, torch.zeros(64, **i32),
                                 torch.zeros(64, **i32), torch.zeros(64, **i32), 0.1,
                                 num_splits=splits)
            shared_prefix_attention(q, q, torch.zeros(64, hq), pool, pool, table,
                                    torch.zeros(2, **i32), torch.zeros(1, **i32),
                                    torch.zeros(1, **i32), 64, 1024, 0.1, num_splits=4)
            store_kv(pool, pool, torch.zeros(64, dtype=torch.int64), kv, kv)
    print(f"{len(seen)} variants compiled for sm_90")


if __name__ == "__main__":
    main()
