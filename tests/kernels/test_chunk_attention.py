"""A document's later prefill chunk as two attentions merged by their log-sum-exp
(`fused_chunks.chunk_attention`): the chunk against the earlier tokens, every key visible,
and against itself, causal, its rows padded to a multiple of CHUNK_ROWS; after a short prior
(at most CHUNK_ROWS tokens), one causal call over prior and chunk together. On a GPU the two
parts are cuDNN's (tests/gpu/test_fused_causal.py); cuDNN cannot run here, so the parts come
from a reference attention with the same contract, and the padding and the merge (the Triton
merge kernel, interpreted) are what is checked."""

import pytest
import torch
from checks import DEVICE

from ppqa.engine.attention.fused_chunks import CHUNK_ROWS, chunk_attention


def reference_attend(calls):
    def attend(q, k, v, *, causal: bool, scale: float):
        """q [1, H, T, D], k/v [1, H, S, D] -> (o [T, H, D], lse [T, H], natural log)."""
        calls.append((q.shape[2], k.shape[2], causal))
        s = torch.einsum("htd,hsd->hts", q[0].double(), k[0].double()) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,hsd->htd", torch.softmax(s, -1), v[0].double())
        return o.transpose(0, 1).float(), torch.logsumexp(s, -1).transpose(0, 1).float()
    return attend


def causal_reference(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, 1) for x in (k, v))
    s = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v.double()).float()


@pytest.mark.parametrize("prior,tokens,heads,kv_heads", [(700, 300, 6, 2), (96, CHUNK_ROWS, 4, 4),
                                                        (1, 2 * CHUNK_ROWS + 5, 4, 1),
                                                        (54, 1000, 6, 2)])
def test_a_later_chunk_padded_and_merged_is_causal_attention(prior, tokens, heads, kv_heads):
    gen = torch.Generator().manual_seed(prior + tokens)
    d = 16
    q, k, v = (torch.randn(prior + tokens, h, d, generator=gen).to(DEVICE)
               for h in (heads, kv_heads, kv_heads))
    o = torch.full((tokens, heads, d), float("nan"), device=DEVICE)
    calls: list = []
    scale = d ** -0.5
    chunk_attention(q[prior:], k[prior:], v[prior:], k[:prior], v[:prior], o, scale,
                    attend=reference_attend(calls))
    if prior > CHUNK_ROWS:
        rows = -(-tokens // CHUNK_ROWS) * CHUNK_ROWS
        # The chunk's rows padded, the earlier tokens (the unmasked part's keys) exact.
        assert calls == [(rows, prior, False), (rows, rows, True)]
    else:  # a short prior: one causal call over prior + chunk, padded as a whole
        rows = -(-(prior + tokens) // CHUNK_ROWS) * CHUNK_ROWS
        assert calls == [(rows, rows, True)]
    ref = causal_reference(q, k, v, scale)[prior:]
    assert torch.allclose(o, ref, atol=1e-5, rtol=1e-4), (o - ref).abs().max()
