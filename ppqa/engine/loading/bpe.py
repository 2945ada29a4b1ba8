"""SmolLM2's BPE tokenizer for dummy models: `dummy:<preset>+bpe` (engine/loading/loader.py).

Random weights do not care which tokenizer feeds them, but a benchmark does: with the byte
tokenizer a question is ~60 tokens and a "16k-token" document 16 kB of text. With a real BPE
vocabulary (49,152 tokens) a question is ~20 tokens, as it is with real models, and every id a
random model emits decodes to text, so comparing answers across modes compares real strings.

The tokenizer comes from the embedded SmolLM2 GGUF in the model cache (`model_cache.ensure`, so
it works offline once the file is there). Building it from GGUF metadata takes ~5 s (transformers
rebuilds the vocabulary in Python) and needs the `gguf` package; the result is saved once as a
`tokenizer.json` folder beside the GGUF file, which later loads with the `tokenizers` library
alone (json_tokenizer.py) in ~0.1 s, without `gguf` or `transformers`.
"""

from __future__ import annotations

from pathlib import Path

from ppqa.engine.loading.types import ModelLoadError

BPE_MODEL = "smollm2"  # the embedded model whose tokenizer `+bpe` borrows


def tokenizer_dir(root: Path | None = None) -> Path:
    """Where the saved tokenizer lives: beside the GGUF, named after its checksum."""
    from ppqa.engine.loading import model_cache

    model = model_cache.EMBEDDED[BPE_MODEL]
    return model_cache.embedded_path(BPE_MODEL, root).parent / f"tokenizer-{model.sha256[:12]}"


def bpe_tokenizer(root: Path | None = None):
    """SmolLM2's tokenizer: the saved folder as a `JsonTokenizer` (no `transformers` import),
    else built from the GGUF by `transformers`, saved, and read back from the folder."""
    from ppqa.engine.loading.tokenizer import HFTokenizer

    from ppqa.engine.loading.json_tokenizer import JsonTokenizer, save_checked

    saved = tokenizer_dir(root)
    if (saved / "tokenizer.json").is_file():
        try:
            return JsonTokenizer(saved)
        except Exception as e:  # noqa: BLE001 -- the tokenizers library raises many kinds
            raise ModelLoadError(f"cannot load the saved {BPE_MODEL} tokenizer in {saved} "
                                 f"(delete the folder to rebuild it): {type(e).__name__}: {e}") from e
    hf = _build_from_gguf(saved, root)
    return JsonTokenizer(saved) if save_checked(hf, saved) else HFTokenizer(hf)


def transformers_tokenizer(root: Path | None = None):
    """The saved tokenizer as a `transformers` object, for tools that need one (the grammar
    libraries' converters in benchmarks/grammar_mask.py, the tests that compare against it);
    built first as `bpe_tokenizer` builds it."""
    bpe_tokenizer(root)
    return _load_saved(tokenizer_dir(root))


def _load_saved(saved: Path):
    # Not AutoTokenizer: transformers 5 swaps in another pre-tokenizer for this folder (it then
    # splits "\n\n" differently); the fast class keeps the one in tokenizer.json.
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(str(saved), local_files_only=True)


def _build_from_gguf(saved: Path, root: Path | None):
    from ppqa.engine.loading import model_cache
    from ppqa.engine.loading.gguf import transformers_tokenizer

    path = model_cache.ensure(BPE_MODEL, root)
    try:
        import gguf  # noqa: F401 -- transformers needs it to read GGUF metadata
    except ImportError as e:
        raise ModelLoadError(f"the +bpe tokenizer is built once from {path}, which needs the `gguf` "
                             f"package (pip install gguf), or copy a saved {saved.name} folder "
                             f"into {saved.parent}") from e
    return transformers_tokenizer(path)
