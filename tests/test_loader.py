"""load_model: dummy presets (shapes, seeding, dtype, usable greedy streams) and spec errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ppqa.engine.loading.loader import LazyWeights, ModelLoadError, load_model, preset_names
from ppqa.engine.loading.presets import PRESETS, weight_shapes
from ppqa.engine.loading.tokenizer import ByteTokenizer
from tests.helpers import hf_twin

# Parameter counts of the real models these presets copy (from their model cards / HF configs).
REAL_PARAMS = {"codellama-7b": 6_738_546_688, "llama-3-8b": 8_030_261_248,
               "qwen2.5-7b": 7_615_616_512, "qwen2.5-1.5b": 1_543_714_304}
TINY = ["tiny-mha", "tiny-gqa", "tiny-odd"]


def test_preset_names():
    assert set(REAL_PARAMS) | set(TINY) <= set(preset_names())


@pytest.mark.parametrize("name", list(REAL_PARAMS))
def test_big_presets_match_the_real_architectures(name):
    config = PRESETS[name].config
    assert sum(math.prod(shape) for _, shape in weight_shapes(config)) == REAL_PARAMS[name]
    # The benchmark needs 16k documents + questions + 1,024 answer tokens.
    assert config.max_position_embeddings >= 32768


def test_big_preset_details():
    assert PRESETS["codellama-7b"].config.num_kv_heads == 32
    assert PRESETS["codellama-7b"].config.rope_theta == 1e6
    llama3 = PRESETS["llama-3-8b"].config
    assert llama3.num_kv_heads == 8 and llama3.rope_theta == 500000.0
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_scaling["factor"] == 8.0
    qwen = PRESETS["qwen2.5-7b"].config
    assert qwen.attention_bias and qwen.num_kv_heads == 4 and not qwen.tie_word_embeddings
    assert PRESETS["qwen2.5-1.5b"].config.tie_word_embeddings


@pytest.mark.parametrize("name", TINY)
def test_tiny_dummy_weights(name):
    model = load_model(f"dummy:{name}", seed=3)
    config = model.config
    assert isinstance(model.weights, LazyWeights)
    assert isinstance(model.tokenizer, ByteTokenizer) and model.tokenizer.vocab_size == config.vocab_size
    assert config.eos_token_ids == model.tokenizer.eos_token_ids
    assert config.bos_token_id == model.tokenizer.bos_token_id
    weights = list(model.weights)
    assert [(n, tuple(w.shape)) for n, w in weights] == list(weight_shapes(config))
    assert len(weights) == len(model.weights)
    assert ("lm_head.weight" in dict(weights)) != config.tie_word_embeddings
    for n, w in weights:
        assert w.dtype == torch.float32 and w.device.type == "cpu"
        if n.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w))
        elif w.numel() > 1000:
            assert abs(w.std().item() - PRESETS[name].init_std) < 0.02 and abs(w.mean().item()) < 0.02
    # Re-iterating regenerates the same values; another seed gives others.
    again = dict(model.weights)
    assert all(torch.equal(w, again[n]) for n, w in weights)
    other = dict(load_model(f"dummy:{name}", seed=4).weights)
    assert not torch.equal(other["model.embed_tokens.weight"], again["model.embed_tokens.weight"])


def test_dummy_weights_in_requested_dtype():
    model = load_model("dummy:tiny-gqa", dtype=torch.bfloat16, device="cpu")
    assert {w.dtype for _, w in model.weights} == {torch.bfloat16}
    assert "q_proj.bias" in " ".join(n for n, _ in model.weights)


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_do_not_collapse_under_greedy_decoding(name):
    # The engine's golden tests need varied streams; check with transformers' own implementation.
    model = load_model(f"dummy:{name}")
    twin = hf_twin(model.config, model.weights)
    streams = []
    for text in ("The quick brown fox", "Question: what is 2+2?", "hello"):
        ids = torch.tensor([[model.tokenizer.bos_token_id, *model.tokenizer.encode(text)]])
        out = twin.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert len(set(out[16:])) >= 8, out  # still varied after 16 steps, not a loop of one token
        streams.append(out)
    assert streams[0] != streams[1] != streams[2]


def test_unknown_specs_raise_model_load_error():
    with pytest.raises(ModelLoadError, match="unknown dummy preset 'nope'.*tiny-mha"):
        load_model("dummy:nope")
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*smollm2.*codellama-7b"):
        load_model("no-such-model")
    assert issubclass(ModelLoadError, ValueError)
    with pytest.raises(ModelLoadError, match="floating-point"):
        load_model("dummy:tiny-mha", dtype=torch.int8)


def test_pickled_checkpoints_are_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        load_model(str(path))
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor"):
        load_model(str(notes))
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path))


def test_dummy_models_need_none_of_the_packages_the_gpu_machine_lacks():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ppqa.engine.loading.loader import load_model\n"
        "m = load_model('dummy:tiny-gqa')\n"
        "n = sum(w.numel() for _, w in m.weights)\n"
        "p = m.tokenizer.prompt('qa', 'doc', ['q?'])\n"
        "bad = [x for x in ('gguf', 'platformdirs', 'sqlalchemy', 'pydantic', 'transformers')"
        " if x in sys.modules]\n"
        "print(n, bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["321408", "[]"], out.stdout + out.stderr
