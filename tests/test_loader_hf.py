"""Hugging Face directories: config mapping, sharded safetensors, tokenizer files, refusals.

Each test writes a tiny model directory (config.json, two safetensors shards + index, tokenizer
files saved by transformers) and loads it; transformers' own `from_pretrained` of the same
directory is the reference for the config mapping (rope scaling, q/k/v bias, tied embeddings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ppqa.engine.loading.loader import ModelLoadError, load_model
from ppqa.engine.loading.presets import weight_shapes
from tests.helpers import hf_twin

VOCAB_SIZE = 300
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB_SIZE,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 1024, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
         "bos_token_id": 0, "eos_token_id": 1}
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB_SIZE,
         "hidden_size": 72, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 1024, "tie_word_embeddings": True, "use_sliding_window": False,
         "sliding_window": 1024, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "eos_token_id": 2}


def save_tokenizer(directory: Path, *, chat: bool, bos: bool) -> None:
    """A byte-level BPE tokenizer (specials 0-2, 256 bytes, a few merges) in transformers' format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<|im_end|>", "<|im_start|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet + ["he", "Ġt", "Ġthe"])}
    backend = Tokenizer(models.BPE(vocab, [("h", "e"), ("Ġ", "t"), ("Ġt", "he")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if bos:  # like Llama: the tokenizer adds BOS to every encoding
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    if chat:
        tok.chat_template = CHAT
    tok.save_pretrained(str(directory))


def write_hf_dir(directory: Path, config: dict, *, shards: int = 2, seed: int = 0,
                 chat: bool = False, bos: bool = True) -> dict[str, torch.Tensor]:
    """config.json + sharded safetensors + index + tokenizer; returns the weights written."""
    from ppqa.engine.loading.hf import config_from_hf

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    ours = config_from_hf(config, directory)
    gen = torch.Generator().manual_seed(seed)
    weights = {n: (1 + 0.1 * torch.randn(s, generator=gen)) if n.endswith("norm.weight")
               else 0.1 * torch.randn(s, generator=gen) for n, s in weight_shapes(ours)}
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old files carry it
    names = sorted(weights)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n].to(torch.bfloat16) for n in part}, str(directory / shard))
        weight_map.update({n: shard for n in part})
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_tokenizer(directory, chat=chat, bos=bos)
    return {n: w.to(torch.bfloat16) for n, w in weights.items()}


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama3-rope", "qwen2-tied"])
def test_hf_dir_matches_transformers(tmp_path, config):
    import transformers

    written = write_hf_dir(tmp_path / "m", config, chat=config is QWEN2, bos=config is LLAMA)
    model = load_model(str(tmp_path / "m"), dtype=torch.float32)
    assert "2 safetensors files" in model.source
    loaded = dict(model.weights)
    expected = {n for n in written if "rotary_emb" not in n}
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(loaded) == expected
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, written[name].float()), name
    # Same logits as transformers' own load of the directory: the config mapping is right.
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    twin = hf_twin(model.config, model.weights)
    ids = torch.randint(3, VOCAB_SIZE, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_config_mapping_details(tmp_path):
    llama = load_model(str(_dir(tmp_path / "a", LLAMA))).config
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert (llama.num_kv_heads, llama.head_dim, llama.attention_bias) == (2, 16, False)
    qwen = load_model(str(_dir(tmp_path / "b", QWEN2, chat=True, bos=False))).config
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.head_dim == 24


def _dir(path: Path, config: dict, **kw) -> Path:
    write_hf_dir(path, config, **kw)
    return path


def test_tokenizer_bos_chat_template_and_generation_eos(tmp_path):
    plain = load_model(str(_dir(tmp_path / "plain", LLAMA, shards=1, bos=True))).tokenizer
    assert plain.add_bos and plain.chat_template is None
    prompt = plain.prompt("qa", "the text", ["Why?"])
    assert prompt.prefix_ids[0] == 0 and prompt.prefix_ids.count(0) == 1  # BOS once, at the start
    assert plain.decode(prompt.suffix_ids[0]) == "\n\nQuestion: Why?\nAnswer:"

    path = _dir(tmp_path / "chat", QWEN2, chat=True, bos=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    chat = load_model(str(path))
    assert chat.tokenizer.eos_token_ids == [1, 2] == chat.config.eos_token_ids
    prompt = chat.tokenizer.prompt("qa", "the text", ["Why?"])
    with_specials = chat.tokenizer.backend.decode  # the checked copy (a JsonTokenizer)
    assert with_specials(prompt.prefix_ids, skip_special_tokens=False).startswith(
        "<|im_start|>user\n")
    assert with_specials(prompt.suffix_ids[0], skip_special_tokens=False).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")


def test_refusals_and_broken_dirs(tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(LLAMA))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*never loads"):
        load_model(str(pickled))

    holed = _dir(tmp_path / "holed", LLAMA)
    (holed / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002.safetensors"):
        load_model(str(holed))

    wrong = _dir(tmp_path / "wrong", LLAMA, shards=1)
    (wrong / "config.json").write_text(json.dumps({**LLAMA, "intermediate_size": 100}))
    with pytest.raises(ModelLoadError, match="do not match config.json.*mlp"):
        load_model(str(wrong))

    (wrong / "config.json").write_text(json.dumps({**LLAMA, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(str(wrong))

    (wrong / "config.json").write_text(json.dumps({**LLAMA, "model_type": "mistral",
                                                   "sliding_window": 256}))
    with pytest.raises(ModelLoadError, match="sliding-window"):
        load_model(str(wrong))

    (wrong / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(wrong))


def test_a_folders_tokenizer_is_built_once_then_read_without_transformers(tmp_path, ppqa_home):
    """The first load builds the tokenizer with transformers and keeps a checked copy under
    $PPQA_HOME/tokenizers; a later process reads that copy and never imports transformers,
    with the same ids, chat rendering and EOS ids as transformers' own tokenizer. A changed
    tokenizer file gets a copy of its own, and the earlier one is deleted."""
    import subprocess
    import sys

    from ppqa.engine.loading.json_tokenizer import JsonTokenizer
    from ppqa.engine.loading.tokenizer import HFTokenizer

    path = _dir(tmp_path / "m", QWEN2, chat=True, bos=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    first = load_model(str(path)).tokenizer
    (saved,) = (ppqa_home / "tokenizers").iterdir()
    assert isinstance(first, JsonTokenizer) and saved.name.startswith("m-")
    import transformers

    reference = HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(path)),
                            extra_eos_ids=[1, 2])
    text, chat = "the hello\n\n  Why?", [{"role": "user", "content": "so the hello"}]
    assert first.encode(text) == reference.encode(text)
    assert first.render_messages(chat) == reference.render_messages(chat)
    assert first.eos_token_ids == reference.eos_token_ids == [1, 2]
    probe = ("import json, sys; from ppqa.engine.loading.loader import load_model; "
             f"tok = load_model({str(path)!r}).tokenizer; "
             f"print(json.dumps([tok.encode({text!r}), 'transformers' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PPQA_HOME": str(ppqa_home)}, check=True)
    ids, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert ids == reference.encode(text) and not imported

    template = path / "chat_template.jinja"  # where transformers 5 saves it; 4, in the config
    if template.is_file():
        template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    else:
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ")
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    changed = load_model(str(path)).tokenizer
    assert changed.render_messages(chat).startswith("<|im_start|> user")
    (now,) = (ppqa_home / "tokenizers").iterdir()
    assert now != saved and not saved.exists()

