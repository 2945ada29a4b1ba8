"""A second `stock` baseline: FlashInfer's paged decode kernel in place of ours.

`FlashInferBackend` is the Triton backend with one path swapped: a stock decode step (one token
per request, no cascade) runs FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` over the same
pool, viewed as pages of one token ([slots, 1, kv_heads, head_dim], "NHD"). Every other step
(document and question prefill, cascade, parallel) keeps the Triton kernels, so `stock` on
this backend differs from `stock` on ours in the decode attention kernel alone.

Per step (`init_forward_metadata`), the requests' rows become FlashInfer's page table:
`paged_kv_table` packs row[0 : prefix_len + 1] of each request (the new token's slot
included) into indptr / indices; indptr is built on the host from the step's host lengths
(FlashInfer plans its split on the host), indices on the device without a host round trip.
The plan is shared by all layers. FlashInfer's plan is eager, so this backend runs without
CUDA graphs (engine/setup.py); at the batch sizes it is compared on (16k/256: ~0.2 s a step)
the launches are under 2% of a step.

FlashInfer is optional and not a dependency of ppqa: its 0.2.x source release compiles its
kernels with the machine's nvcc at first use (benchmarks/flashinfer_device.sh).
"""

from __future__ import annotations

import torch

from ppqa.engine.attention.metadata import ForwardMetadata
from ppqa.engine.attention.triton_backend import TritonBackend
from ppqa.kernels.kv_store import store_kv

WORKSPACE_BYTES = 256 << 20
# Query heads per KV head that FlashInfer 0.2.5's CUDA-core decode dispatches; it is faster
# than its tensor-core path on MHA (benchmarks/RESULTS.md, "FlashInfer's paged decode per
# layer"), which larger or other groups take.
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)


def paged_kv_table(req_to_token: torch.Tensor, req_indices: torch.Tensor,
                   host_lens: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr on the host [B+1] int32, indices on the table's device [sum + 1] int32): request
    b's KV pages are its row's first host_lens[b] slots, indices[indptr[b] : indptr[b+1]].
    The last index is a dump for the padding of the packing scatter (never read)."""
    lens = host_lens.to(torch.int64)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=indptr[1:])
    total = int(indptr[-1])
    dev = req_to_token.device
    rows = req_to_token[req_indices.long(), :max_len]  # [B, max_len]
    cols = torch.arange(max_len, device=dev)
    lens_d, starts = lens.to(dev, non_blocking=True), indptr[:-1].to(dev, non_blocking=True)
    dest = torch.where(cols[None, :] < lens_d[:, None], starts[:, None] + cols[None, :], total)
    indices = torch.empty(total + 1, dtype=torch.int32, device=dev)
    indices.scatter_(0, dest.reshape(-1), rows.reshape(-1).to(torch.int32))
    return indptr.to(torch.int32), indices


class FlashInferBackend(TritonBackend):
    def __init__(self, pool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float,
                 scratch_bytes: int | None = None, overlap: bool = True) -> None:
        import flashinfer  # engine/setup.py's _check_flashinfer has said why it may be missing

        super().__init__(pool, num_heads, num_kv_heads, head_dim, sm_scale, scratch_bytes,
                         overlap)
        group = num_heads // num_kv_heads
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.tensor_cores = group not in CUDA_CORE_GROUPS
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.tensor_cores)
        self.pages = [(k.unsqueeze(1), v.unsqueeze(1))
                      for k, v in zip(pool.k_buffers, pool.v_buffers)]

    def init_forward_metadata(self, meta: ForwardMetadata) -> None:
        super().init_forward_metadata(meta)
        if not self._flashinfer_step(meta):
            return
        if meta.host_prefix_lens is None:
            raise ValueError("FlashInferBackend needs ForwardMetadata.host_prefix_lens")
        lens = meta.host_prefix_lens + 1  # the new token's slot is in the row at prefix_len
        indptr, indices = paged_kv_table(meta.req_to_token, meta.req_indices, lens,
                                         int(lens.max()))
        self.wrapper.plan(indptr, indices, torch.ones(meta.batch_size, dtype=torch.int32),
                          self.num_heads, self.num_kv_heads, self.head_dim, 1,
                          sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)

    @staticmethod
    def _flashinfer_step(meta: ForwardMetadata) -> bool:
        return meta.kind == "decode" and meta.cascade is None and meta.batch_size > 0

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: ForwardMetadata) -> torch.Tensor:
        if not self._flashinfer_step(meta):
            return super().forward(layer, q, k, v, meta)
        if self._meta is not meta:
            self.init_forward_metadata(meta)
        store_kv(self.pool.k_buffers[layer], self.pool.v_buffers[layer], meta.out_slots, k, v)
        return self.wrapper.run(q, self.pages[layer])
