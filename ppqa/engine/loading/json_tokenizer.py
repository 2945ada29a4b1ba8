"""A tokenizer read straight from a saved Hugging Face folder, without `transformers`.

`JsonTokenizer` loads `tokenizer.json` with the `tokenizers` library (the Rust tokenizer that
`transformers`' fast tokenizers wrap), its special tokens and chat template from
`tokenizer_config.json` (or `chat_template.jinja`), and renders the chat template with Jinja2
the way `transformers` does (a sandbox, `trim_blocks` and `lstrip_blocks`, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII text). Importing `transformers` costs a
worker 1-3 s at start-up (results/h200/startup_warm_helpers.json: 2.8 s of a 6.7 s `Engine()`),
so the folders ppqa saves itself load this way: the `+bpe` tokenizer (engine/loading/bpe.py), and
the checked copies of a GGUF file's or a model folder's tokenizer (`saved_or_built`) under
`$PPQA_HOME/tokenizers/`; tests/test_json_tokenizer.py checks it against `transformers` on the
same folder.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ppqa.engine.loading.tokenizer import HFTokenizer, Tokenizer, drop_cut_character

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# What transformers' clean_up_tokenization removes: spaces before punctuation and contractions.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class JsonTokenizer(Tokenizer):
    """The tokenizer saved in `folder` (tokenizer.json + tokenizer_config.json); `extra_eos_ids`
    end answers as well as its EOS token (a GGUF's end-of-turn ids, as `HFTokenizer` takes)."""

    tokenizes_off_thread = True  # `encode_batch` releases the GIL while it works

    def __init__(self, folder: str | Path, *, extra_eos_ids: Sequence[int] = ()) -> None:
        import tokenizers

        self.folder = Path(folder)
        self.backend = tokenizers.Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        config_path = self.folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {name: _content(config.get(name))
                               for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token_id = self._id(self.special_tokens["bos_token"])
        eos = self._id(self.special_tokens["eos_token"])
        self.eos_token_ids = sorted(({eos} - {None}) | {int(i) for i in extra_eos_ids})
        template_file = self.folder / "chat_template.jinja"
        self.chat_template = (template_file.read_text() if template_file.is_file()
                              else config.get("chat_template")) or None
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        with_specials = self.backend.encode("a", add_special_tokens=True).ids
        self.add_bos = (self.bos_token_id is not None and with_specials[:1] == [self.bos_token_id]
                        and self.encode("a")[:1] != [self.bos_token_id])

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        return drop_cut_character(self._decode(ids), lambda: self._decode(ids[-1:]))

    def _decode(self, ids: list[int]) -> str:
        text = self.backend.decode(ids, skip_special_tokens=True)
        if self.clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    @functools.cached_property
    def max_token_bytes(self) -> int:
        # As HFTokenizer's: vocabulary strings overstate the bytes they stand for.
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8")) for t in vocab), default=1) or 1

    def render_messages(self, messages: Sequence[Mapping[str, str]], *,
                        add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise NotImplementedError("this tokenizer has no chat template")
        names = {k: v for k, v in self.special_tokens.items() if v is not None}
        return _compiled(self.chat_template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            **names)

    def save_pretrained(self, folder: str | Path) -> None:
        """Copy the tokenizer's files into `folder` (a Hugging Face model folder)."""
        for name in FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, Path(folder) / name)


# Text whose tokens tell tokenizers apart: blank lines, runs of spaces, digits, accents, CJK.
_PROBE = "Read the document.\n\nDocument:\n  Caf\u00e9 2024 -- 12,345 \u6771\u4eac\tend.\n\n\nQ: why?"


def save_checked(hf, folder: Path) -> bool:
    """Save the `transformers` tokenizer `hf` as `folder` for later loads to read as a
    JsonTokenizer, if that copy, read back, tokenizes the probe, renders a chat and names its
    special tokens as `hf` does; True if `folder` holds a saved tokenizer afterwards. Where the
    copy differs, or the folder's parent cannot be written, nothing is kept (every load then
    builds from the source, slowly but right). Concurrent savers of one folder are safe: each
    writes its own and the first rename wins."""
    chat = [{"role": "user", "content": _PROBE}]
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    except OSError:
        return False
    try:
        try:
            hf.save_pretrained(str(tmp))
            again, before = JsonTokenizer(tmp), HFTokenizer(hf)
        except Exception:  # noqa: BLE001 -- no room, or a copy the tokenizers library refuses
            return False
        if again.encode(_PROBE) != before.encode(_PROBE) \
                or again.chat_template != before.chat_template \
                or again.vocab_size != before.vocab_size \
                or (again.bos_token_id, again.eos_token_ids, again.add_bos) \
                != (before.bos_token_id, before.eos_token_ids, before.add_bos) \
                or (before.chat_template and again.render_messages(chat)
                    != before.render_messages(chat)):
            return False
        try:
            os.replace(tmp, folder)  # atomic: a concurrent builder's folder wins, equal anyway
        except OSError:
            pass
        return (folder / "tokenizer.json").is_file()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def saved_dir(source: Path, versioned: Sequence[Path]) -> Path:
    """Where the tokenizer built from `source` (a GGUF file, or a model folder) is saved:
    `$PPQA_HOME/tokenizers/`, named after it and keyed by its real path and by the size and
    modification time of each file in `versioned` (the files it is built from), so that a
    source replaced or changed gets a tokenizer of its own."""
    from ppqa.paths import ppqa_home

    real = source.resolve()
    key = str(real)
    for path in versioned:
        stat = path.stat()
        key += f"\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    return ppqa_home() / "tokenizers" / f"{_saved_name(real)}-{digest[:16]}"


def _saved_name(real: Path) -> str:
    """A saved copy's name: the GGUF file's stem, or the model folder's name."""
    return real.name if real.is_dir() else real.stem


def saved_or_built(saved: Path, source: Path, build: Callable[[], Any], *,
                   extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
    """The tokenizer of `source`: the copy an earlier process saved as `saved` (`saved_dir`)
    read as a `JsonTokenizer` (~0.1 s, no `transformers` import), else `build()`'s
    `transformers` tokenizer, saved where the copy checks out (`save_checked`; the copies of
    the source's earlier versions are then deleted) and read back, or used as it is."""
    if (saved / "tokenizer.json").is_file():
        try:
            return JsonTokenizer(saved, extra_eos_ids=extra_eos_ids)
        except Exception:  # noqa: BLE001 -- a damaged copy: build it again below
            shutil.rmtree(saved, ignore_errors=True)
    hf = build()
    if save_checked(hf, saved):
        _forget_earlier_versions(source, saved)
        return JsonTokenizer(saved, extra_eos_ids=extra_eos_ids)
    return HFTokenizer(hf, extra_eos_ids=extra_eos_ids)


def _forget_earlier_versions(source: Path, saved: Path) -> None:
    """Mark `saved` as the tokenizer of `source`'s real path (a `source` file beside it) and
    delete the tokenizers saved for earlier versions of it (same path, other files' sizes or
    modification times): each is a few MB that nothing reads again."""
    resolved = source.resolve()
    real = str(resolved)
    try:
        (saved / "source").write_text(real)
    except OSError:
        return
    for other in saved.parent.glob(f"{glob.escape(_saved_name(resolved))}-*"):
        if other == saved or not other.is_dir():
            continue
        try:
            origin = (other / "source").read_text()
        except OSError:
            continue
        if origin == real:
            shutil.rmtree(other, ignore_errors=True)


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text}."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """A chat template compiled as transformers compiles one (its Jinja2 environment)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
