"""Shared settings and comparison for the kernel tests: sizes (tiny under the CPU interpreter,
model-sized on a GPU), per-dtype tolerances, and an assert that prints the error it judged."""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# (num_heads, num_kv_heads, head_dim): MHA and GQA (a group of 3 or 7 is not a power of two).
HEADS = [(32, 32, 128), (28, 4, 128)] if ON_GPU else [(2, 2, 16), (6, 2, 16)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error allowed against the float64 reference; bf16 is the paper's 0.03.
ATOL = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 3e-2}


def poisoned(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str):
    """Every element written (no NaN left from the poison) and within the dtype's tolerance."""
    got = out.detach().double().cpu()
    assert not torch.isnan(got).any(), f"{what}: {int(torch.isnan(got).sum())} elements unwritten"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: infinities differ from reference"
    err = (got[finite] - ref[finite]).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    rel = float(err.norm() / ref[finite].norm().clamp_min(1e-30)) if err.numel() else 0.0
    print(f"{what} {str(dtype).split('.')[-1]}: max abs err {max_err:.2e}, rel err norm {rel:.2e}")
    assert max_err <= ATOL[dtype], f"{what}: max abs error {max_err:.3e} > {ATOL[dtype]:.0e}"


def case_id(value) -> str:
    """Readable pytest ids: (37, 1, 1) -> 37x1x1, torch.bfloat16 -> bfloat16."""
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value).split(".")[-1]
