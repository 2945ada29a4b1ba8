"""The fused elementwise kernels (ppqa.kernels.fused) against their torch references, and the
model's fused path against its torch path.

Bit-exact (torch.equal): the residual sum, the rotary embedding, and on a GPU SiLU * up. Within
ulps of the output dtype: RMSNorm (Triton sums the squares in another order than torch) and,
under the interpreter, SiLU * up (numpy's exp is not torch's); the counts of differing elements
are printed.
"""

import pytest
import torch
from checks import DEVICE, DTYPES, ON_GPU, case_id

from ppqa.engine.model.llama import build_model
from ppqa.engine.model.rope import RotaryEmbedding
from ppqa.engine.loading.presets import dummy_weights, preset_config
from ppqa.kernels.fused import (
    add_rms_norm, add_rms_norm_ref, apply_rope, apply_rope_ref, rms_norm, rms_norm_ref,
    silu_and_mul, silu_and_mul_ref,
)

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# The most a value may differ from the reference, in units in the last place of the reference.
# bf16/fp16: a normalized value rounded the other way (1 ulp) can become 2 after the weight's
# multiply. fp32: a sum of squares in another order (up to ~log2(n) ulp apart, halved by the
# rsqrt) or an exp's last bit, then one or two roundings; 3 ulp was the worst seen here.
MAX_ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}
SIZES = [64, 96] + ([4096] if ON_GPU else [])  # hidden (or intermediate) sizes
TOKENS = [1, 3, 7]


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    ref64, out64 = ref.double().cpu(), out.double().cpu()
    _, exponent = torch.frexp(ref64)  # |ref| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.ones_like(ref64), exponent - 1 - MANTISSA_BITS[ref.dtype])
    ulps = (out64 - ref64).abs() / ulp
    worst = float(ulps.max())
    print(f"{what}: {int((ulps > 0).sum())} of {ulps.numel()} differ, worst {worst:.2f} ulp")
    assert worst <= MAX_ULPS[ref.dtype], f"{what}: {worst:.2f} ulp from the reference"


def randn(*shape, gen, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("hidden", SIZES)
def test_add_rms_norm_matches_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    weight = randn(hidden, gen=gen, dtype=dtype, scale=0.3) + 1
    for tokens in TOKENS:
        # x a row-strided view, as a slice of a wider activation would be
        x = randn(tokens, hidden + 8, gen=gen, dtype=dtype, scale=2.0)[:, 3:hidden + 3]
        residual = randn(tokens, hidden, gen=gen, dtype=dtype, scale=5.0)
        normed, summed = add_rms_norm(x, residual, weight, 1e-5)
        normed_ref, summed_ref = add_rms_norm_ref(x, residual, weight, 1e-5)
        assert torch.equal(summed, summed_ref), f"T={tokens}: x + residual rounds differently"
        assert_within_ulps(normed, normed_ref, f"add_rms_norm T={tokens}")
        assert_within_ulps(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5),
                           f"rms_norm T={tokens}")


def test_residual_add_rounds_half_to_even_and_keeps_nan():
    """bf16 sums exactly halfway between two bf16 values (1 + 2^-8 lies between 1 and 1 + 2^-7)."""
    ulp = 2.0 ** -7
    x = torch.tensor([[1.0, 1.0 + ulp, -1.0, -(1.0 + ulp), 3.0, float("nan"), 2.0 - ulp, 0.5]])
    r = torch.tensor([[ulp / 2, ulp / 2, -ulp / 2, -ulp / 2, 3 * ulp, 1.0, ulp / 2, 0.25]])
    x, r = x.to(torch.bfloat16).to(DEVICE), r.to(torch.bfloat16).to(DEVICE)
    weight = torch.ones(8, dtype=torch.bfloat16, device=DEVICE)
    _, summed = add_rms_norm(x, r, weight, 1e-6)
    expect = x + r
    assert torch.equal(summed[:, :5], expect[:, :5]) and torch.equal(summed[:, 6:], expect[:, 6:])
    assert summed[0, 0] == 1.0 and summed[0, 1] == 1.0 + 2 * ulp  # ties went to the even side
    assert torch.isnan(summed[0, 5])


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("inter", SIZES)
def test_silu_and_mul_matches_reference(inter, dtype):
    gen = torch.Generator().manual_seed(inter + 1)
    for tokens in TOKENS:
        gate_up = randn(tokens, 2 * inter + 6, gen=gen, dtype=dtype, scale=4.0)[:, :2 * inter]
        out, ref = silu_and_mul(gate_up), silu_and_mul_ref(gate_up)
        if ON_GPU:  # CUDA's expf and an IEEE division, as torch's kernel
            assert torch.equal(out, ref), f"T={tokens}: silu_and_mul differs from torch"
        assert_within_ulps(out, ref, f"silu_and_mul T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-odd"] + (["codellama-7b"] if ON_GPU else []))
def test_apply_rope_equals_rotary_embedding(preset, dtype):
    """q and k as views of one qkv projection (strided tokens); head_dim 16, 24 (half 12: a
    masked tile), 128; positions up to the end of the table."""
    config = preset_config(preset)[0]
    rope = RotaryEmbedding(config)
    rope.build(DEVICE)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(dim)
    for tokens in TOKENS:
        qkv = randn(tokens, (heads + 2 * kv_heads) * dim, gen=gen, dtype=dtype, scale=2.0)
        q = qkv[:, :heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        before = qkv.clone()
        positions = torch.randint(0, config.max_position_embeddings, (tokens,), generator=gen)
        positions[0] = config.max_position_embeddings - 1
        positions = positions.to(DEVICE)
        q_out, k_out = apply_rope(q, k, positions, rope.cos, rope.sin)
        q_ref, k_ref = apply_rope_ref(q, k, positions, rope.cos, rope.sin)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), f"T={tokens}"
        q_model, k_model = rope(positions, q, k)  # what the model's torch path computes
        assert torch.equal(q_out, q_model) and torch.equal(k_out, k_model), f"T={tokens}"
        assert torch.equal(qkv, before), "apply_rope wrote into its inputs"
        assert q_out.is_contiguous() and k_out.is_contiguous()


class CausalAttention:
    """Plain causal attention over the step's own tokens (one sequence, no KV pool): the same
    in both paths of the model test, which compares everything around attention."""

    def forward(self, layer, q, k, v, meta):
        group, dtype = q.shape[1] // k.shape[1], q.dtype
        q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).to(dtype)


def _model(preset: str, dtype: torch.dtype, fused_kernels: bool):
    config, std, _ = preset_config(preset)
    weights = dummy_weights(config, std, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    return build_model(config, ((n, w.to(dtype)) for n, w in weights), device=DEVICE, dtype=dtype,
                       fused_kernels=fused_kernels)


# Max abs logit difference between the paths (logits are O(1) to O(10)); seen here: 5e-6 in
# fp32, 0 in bf16 (the few norm outputs that may round the other way move logits by < 0.1).
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=case_id)
@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-odd"])
def test_fused_model_matches_torch_model(preset, dtype):
    models = {fused: _model(preset, dtype, fused) for fused in (False, True)}
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, models[False].config.vocab_size, (9,), generator=gen).to(DEVICE)
    positions = torch.arange(100, 109, device=DEVICE)
    out = {}
    with torch.inference_mode():
        for fused, model in models.items():
            hidden = model(ids, positions, None, CausalAttention())
            out[fused] = hidden, model.compute_logits(hidden)
    hidden_diff = float((out[True][0].float() - out[False][0].float()).abs().max())
    logit_diff = float((out[True][1] - out[False][1]).abs().max())
    print(f"{preset} {dtype}: hidden max diff {hidden_diff:.2e}, logits max diff {logit_diff:.2e}")
    assert logit_diff <= LOGIT_ATOL[dtype]
    assert torch.equal(out[True][1].argmax(-1), out[False][1].argmax(-1))


def test_residual_stream_sums_as_before():
    """The torch path with the residual passed along is bit for bit the old x = x + f(norm(x))."""
    model = _model("tiny-gqa", torch.bfloat16, fused_kernels=False)
    ids = torch.arange(5, device=DEVICE)
    positions = torch.arange(5, device=DEVICE)
    attention = CausalAttention()
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), positions, model.rope, None,
                                    attention)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert torch.equal(model(ids, positions, None, attention), x)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_fused_ops_replay_under_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    x, residual = (randn(256, 4096, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    weight = randn(4096, gen=gen, dtype=torch.bfloat16) + 1
    gate_up = randn(256, 2 * 11008, gen=gen, dtype=torch.bfloat16)
    eager = (*add_rms_norm(x, residual, weight, 1e-5), silu_and_mul(gate_up))  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (*add_rms_norm(x, residual, weight, 1e-5), silu_and_mul(gate_up))
    for t in (x, residual, gate_up):
        t.copy_(randn(*t.shape, gen=gen, dtype=torch.bfloat16))
    graph.replay()
    eager = (*add_rms_norm(x, residual, weight, 1e-5), silu_and_mul(gate_up))
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
