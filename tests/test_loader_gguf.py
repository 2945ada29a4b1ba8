"""GGUF loading: every supported quant type, the q/k un-permutation, metadata, bad files; the
header reader against the `gguf` package's; the tokenizer saved once and read back after
(block types and streamed reads: tests/test_gguf_blocks.py).

Each test writes a tiny Llama GGUF with the `gguf` package's own writer (and quantizer), loads it
with our loader, and compares with the original float weights and with transformers' GGUF loader,
an implementation no one here wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ppqa.engine.loading.gguf import transformers_tokenizer  # the reference ppqa saves
from ppqa.engine.loading.loader import ModelLoadError, load_model

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return SPECIALS + sorted(ByteLevel.alphabet()) + ["he", "Ġt", "Ġthe"]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the transform our loader must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def original_weights(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab_size, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (vocab_size, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,),
                       p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    return {n: (1.0 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight")
                else 0.2 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_tiny_gguf(path: Path, qtype, weights: dict[str, np.ndarray], arch: str = "llama",
                    rope_freqs: np.ndarray | None = None, eot: int | None = None) -> Path:
    vocab = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_chat_template(CHAT)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, KV_HEADS)
        if array.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), array)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Worst error of each type relative to the tensor's largest magnitude (4-bit types: scale/2 per
# block of 32; 8-bit: scale/2 of 127 levels; BF16: 8 mantissa bits).
TOLERANCE = {Q.F32: 1e-7, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.1, Q.Q4_1: 0.1}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_quant_types_dequantize_and_unpermute(tmp_path, qtype):
    originals = original_weights(len(_vocab()))
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype, originals)
    model = load_model(str(path))
    assert qtype.name in model.source
    loaded = dict(model.weights)
    assert set(loaded) == set(originals)
    for name, original in originals.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        err = (got - torch.from_numpy(original)).abs().max().item()
        # q/k rows back in HF order, so the error stays at quantization level.
        assert err <= TOLERANCE[qtype] * np.abs(original).max() + 1e-7, (name, err)


def test_matches_transformers_gguf_loader(tmp_path):
    """Transformers' GGUF reader (its own dequantizer and un-permute) gives the same tensors."""
    import transformers

    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1, original_weights(len(_vocab()), seed=1))
    ours = dict(load_model(str(path)).weights)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


def test_config_and_tokenizer_from_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q8_0, original_weights(len(_vocab())))
    model = load_model(str(path), dtype=torch.bfloat16)
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim) == (LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM)
    assert c.rope_theta == 50000.0 and c.max_position_embeddings == 512 and not c.tie_word_embeddings
    assert c.vocab_size == len(_vocab()) and abs(c.rms_norm_eps - 1e-6) < 1e-12
    assert {w.dtype for _, w in model.weights} == {torch.bfloat16}
    tok = model.tokenizer
    assert tok.eos_token_ids == [2] == c.eos_token_ids and tok.chat_template == CHAT
    assert tok.decode(tok.encode("the hello")) == "the hello"
    assert _vocab().index("Ġthe") in tok.encode("so the")  # merges from the file are used
    prompt = tok.prompt("qa", "Some text.", ["Why?"])
    assert transformers_tokenizer(path).decode(prompt.prefix_ids).startswith("<|im_start|>user\n")


def test_the_files_bos_and_eos_ids_hold_where_transformers_names_other_tokens(tmp_path,
                                                                             monkeypatch):
    """transformers 5.17 builds a GGUF's tokenizer with its BOS token as EOS too; the tokenizer
    ppqa builds and saves ends answers on the file's EOS id and starts them with its BOS."""
    import transformers

    build = transformers.AutoTokenizer.from_pretrained

    def swapped(*args, **kwargs):  # the real build, then BOS and EOS as a version misreads them
        hf = build(*args, **kwargs)
        hf.bos_token, hf.eos_token = hf.eos_token, hf.bos_token
        return hf

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", swapped)
    path = write_tiny_gguf(tmp_path / "swapped.gguf", Q.F32, original_weights(len(_vocab())))
    hf = transformers_tokenizer(path)
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    tok = load_model(str(path)).tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2])


def test_tied_embeddings_when_output_is_absent(tmp_path):
    weights = original_weights(len(_vocab()))
    del weights["lm_head.weight"]
    model = load_model(str(write_tiny_gguf(tmp_path / "tied.gguf", Q.F16, weights)))
    assert model.config.tie_word_embeddings and "lm_head.weight" not in dict(model.weights)


def test_corrupt_and_truncated_files(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf", Q.Q4_0, original_weights(len(_vocab())))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="truncated.gguf.* not a readable GGUF file"):
        list(load_model(str(truncated)).weights)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"NOPE" + data[4:200])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(garbage))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        load_model(str(empty))


def test_unsupported_architecture_and_missing_tensors(tmp_path):
    weights = original_weights(len(_vocab()))
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", Q.F32, weights, arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = write_tiny_gguf(tmp_path / "holes.gguf", Q.F32, weights)
    with pytest.raises(ModelLoadError, match="missing model.layers.1.mlp.up_proj.weight"):
        load_model(str(path))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """A Llama 3.1 file's rope_freqs (llama.cpp's divisors) map back to HF's llama3 rope_scaling."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hc = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                  max_position_embeddings=131072,
                                  rope_parameters={**scaling, "rope_theta": 50000.0})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hc)
    plain = 1.0 / 50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    divisors = (plain / scaled.double()).numpy()
    assert divisors.max() > 7.9 and divisors.min() < 1.01  # the case has all three bands
    path = write_tiny_gguf(tmp_path / "l31.gguf", Q.F16, original_weights(len(_vocab())), rope_freqs=divisors)
    config = load_model(str(path)).config
    assert config.rope_scaling["rope_type"] == "llama3"
    assert {k: config.rope_scaling[k] for k in scaling if k != "rope_type"} == pytest.approx(
        {k: v for k, v in scaling.items() if k != "rope_type"}, rel=1e-5)

    path = write_tiny_gguf(tmp_path / "odd.gguf", Q.F16, original_weights(len(_vocab())),
                           rope_freqs=divisors[::-1].copy())
    with pytest.raises(ModelLoadError, match="not Llama 3's scaling"):
        load_model(str(path))


def _reader_view(path: Path):
    """The `gguf` package's reading of the file: (fields, tensors) in plain values."""
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, t.shape.tolist(), t.tensor_type, t.data, t.data_offset)
               for t in reader.tensors]
    return fields, tensors


def _assert_reads_as_gguf_does(path: Path) -> None:
    from ppqa.engine.loading.gguf_file import GGUFFile

    ours, (fields, tensors) = GGUFFile(str(path)), _reader_view(path)
    assert ours.fields.keys() == fields.keys()
    for key, want in fields.items():
        got = ours.fields[key]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == want, key
    assert [(t.name, t.shape.tolist(), t.tensor_type) for t in ours.tensors] == \
        [(name, shape, kind) for name, shape, kind, _, _ in tensors]
    for t, (name, _, _, data, offset) in zip(ours.tensors, tensors):
        assert t.data.dtype == data.dtype and t.data.shape == data.shape, name
        assert np.array_equal(t.data, data, equal_nan=True), name
        assert t.offset == offset, name  # where the streamed reads begin


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_1], ids=lambda q: q.name)
def test_the_header_reader_reads_what_the_gguf_package_reads(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, original_weights(len(_vocab())),
                           rope_freqs=np.linspace(1, 8, HEAD_DIM // 2), eot=2)
    _assert_reads_as_gguf_does(path)


def test_the_header_reader_reads_smollm2_as_the_gguf_package_does(smollm2_gguf):
    _assert_reads_as_gguf_does(smollm2_gguf)


def test_a_truncated_header_or_another_version_is_refused(tmp_path):
    data = write_tiny_gguf(tmp_path / "good.gguf", Q.F32, original_weights(len(_vocab()))).read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:300])
    with pytest.raises(ModelLoadError, match="short.gguf.* not a readable GGUF file.*truncated"):
        load_model(str(tmp_path / "short.gguf"))
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelLoadError, match="format version 9 is not supported"):
        load_model(str(tmp_path / "v9.gguf"))


def test_the_tokenizer_is_saved_once_and_read_back_without_transformers(tmp_path, ppqa_home,
                                                                         monkeypatch):
    """The first load builds the tokenizer with transformers and saves it under
    $PPQA_HOME/tokenizers; later loads read that copy, which tokenizes, decodes, renders chats
    and ends answers as transformers' does (the GGUF's end-of-turn id among its EOS ids)."""
    from ppqa.engine.loading import gguf as gguf_loading
    from ppqa.engine.loading.json_tokenizer import JsonTokenizer
    from ppqa.engine.loading.tokenizer import HFTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.F32, original_weights(len(_vocab())), eot=1)
    first = load_model(str(path)).tokenizer
    (saved,) = (ppqa_home / "tokenizers").iterdir()
    assert saved == gguf_loading.saved_tokenizer_dir(path) and isinstance(first, JsonTokenizer)
    reference = HFTokenizer(transformers_tokenizer(path), extra_eos_ids=[1])

    def no_transformers(*args):
        raise AssertionError("the saved tokenizer was not used")

    monkeypatch.setattr(gguf_loading, "_hf_tokenizer", no_transformers)
    again = load_model(str(path)).tokenizer
    assert isinstance(again, JsonTokenizer) and again.eos_token_ids == [1, 2]
    chat = [{"role": "user", "content": "so the hello"}]
    for tok in (first, again):
        assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.vocab_size) == \
            (reference.bos_token_id, reference.eos_token_ids, reference.add_bos,
             reference.vocab_size)
        for text in ("the hello", "<|im_start|>so the\n\n  he<|im_end|>", "h e t"):
            assert tok.encode(text) == reference.encode(text)
            assert tok.decode(tok.encode(text)) == reference.decode(reference.encode(text))
        assert tok.render_messages(chat) == reference.render_messages(chat)
        assert tok.prompt("qa", "Some text.", ["Why?"]).ids(0) == \
            reference.prompt("qa", "Some text.", ["Why?"]).ids(0)


def test_a_changed_file_or_a_damaged_copy_builds_the_tokenizer_again(tmp_path, ppqa_home):
    """... and the copy saved for the file's earlier version is deleted, not that of a file of
    the same name in another folder."""
    from ppqa.engine.loading.gguf import saved_tokenizer_dir

    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.F32, original_weights(len(_vocab())))
    (tmp_path / "elsewhere").mkdir()
    namesake = write_tiny_gguf(tmp_path / "elsewhere" / "tiny.gguf", Q.F32,
                               original_weights(len(_vocab())))
    load_model(str(namesake))
    load_model(str(path))
    before = saved_tokenizer_dir(path)
    (before / "tokenizer.json").write_text("{ not json")
    assert load_model(str(path)).tokenizer.encode("the hello") == \
        transformers_tokenizer(path).encode("the hello", add_special_tokens=False)
    assert json.loads((before / "tokenizer.json").read_text())  # saved again, whole
    write_tiny_gguf(path, Q.F32, original_weights(len(_vocab())), eot=1)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert saved_tokenizer_dir(path) != before
    assert load_model(str(path)).tokenizer.eos_token_ids == [1, 2]
    assert sorted(p.name for p in (ppqa_home / "tokenizers").iterdir()) == \
        sorted([saved_tokenizer_dir(namesake).name, saved_tokenizer_dir(path).name])
    assert not before.exists()


def test_a_home_where_nothing_can_be_saved_still_loads_the_tokenizer(tmp_path, ppqa_home):
    from ppqa.engine.loading.tokenizer import HFTokenizer

    ppqa_home.mkdir(parents=True, exist_ok=True)
    (ppqa_home / "tokenizers").write_text("a file where the folder would go")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.F32, original_weights(len(_vocab())))
    tok = load_model(str(path)).tokenizer
    assert isinstance(tok, HFTokenizer) and tok.encode("so the") == \
        transformers_tokenizer(path).encode("so the", add_special_tokens=False)
