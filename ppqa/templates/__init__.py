"""Prompt templates: the built-in `*.jinja` files of this package, and users' `.jinja` files.

A template defines two Jinja2 blocks: `prefix` (the instruction and `{{ document }}`, shared by
every question) and `question` (`{{ question }}`, one per question); one that also defines the
block `rendered` is not wrapped in the model's chat template (see RENDERED_BLOCK). For a question
with choices, the `question` block also sees `choices` (the labels) and `letters` (A, B, ...),
and the optional block `choice` renders the text that is scored after the prompt for one choice
(`choice`, `letter`, `choice_index`); without it the scored text is the label, after a space
unless the model's chat template wraps the prompt (see CHOICE_BLOCK and `choice_context`). The built-in
ones are package data, read through `importlib.resources` so that they are found in an
installed wheel as in a source checkout. Every template renders in one sandboxed environment: users' templates are
untrusted. Jinja2 is imported on first use, so listing names stays cheap for the CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

TEMPLATE_SUFFIX = ".jinja"
REQUIRED_BLOCKS = ("prefix", "question")
# A template that defines this (empty) block holds text that is already the model's whole
# prompt (the built-in `raw`): the tokenizer does not wrap it in the chat template.
RENDERED_BLOCK = "rendered"
# The optional block that renders a choice's scored text (see the module doc).
CHOICE_BLOCK = "choice"


def choice_letters(n: int) -> list[str]:
    """A, B, ..., Z, AA, AB, ...: the letters of n options, as a spreadsheet names columns."""
    out = []
    for i in range(n):
        name, i = "", i + 1
        while i:
            i, rest = divmod(i - 1, 26)
            name = chr(65 + rest) + name
        out.append(name)
    return out


def choice_text(tmpl: Any, context: Mapping[str, Any], index: int) -> str:
    """The scored text of choice `index` of a question rendered with `context` (which holds
    `choices`, `letters` and `chat`): the template's `choice` block, or the label itself."""
    choice = context["choices"][index]
    if CHOICE_BLOCK not in tmpl.blocks:
        return choice if context.get("chat") else " " + choice
    return render_block(tmpl, CHOICE_BLOCK, {**context, "choice": choice,
                                             "letter": context["letters"][index],
                                             "choice_index": index})


def list_templates() -> list[str]:
    """Names of the built-in templates (`ppqa/templates/<name>.jinja`), sorted."""
    return sorted(entry.name[: -len(TEMPLATE_SUFFIX)]
                  for entry in resources.files(__name__).iterdir()
                  if entry.name.endswith(TEMPLATE_SUFFIX) and not entry.name.startswith("_"))


def builtin_source(name: str) -> str:
    """The text of built-in template `name`."""
    return resources.files(__name__).joinpath(name + TEMPLATE_SUFFIX).read_text(encoding="utf-8")


def template_source(template: str) -> tuple[str, str]:
    """(label, text) of a built-in name or a path to a `.jinja` file; ValueError otherwise."""
    if template in list_templates():
        return template, builtin_source(template)
    path = Path(template).expanduser()
    if not (path.suffix == TEMPLATE_SUFFIX or path.exists()):
        raise ValueError(f"unknown template {template!r}: built-in templates are "
                         f"{', '.join(list_templates())}, or give a path to a .jinja file")
    try:
        return str(path), path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read template file {str(path)!r}: {e.strerror or e}") from e


@lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2.sandbox import SandboxedEnvironment

    # The templates' whitespace is part of the prompt, so nothing is trimmed or escaped.
    return SandboxedEnvironment(keep_trailing_newline=False, autoescape=False)


@lru_cache(maxsize=64)
def compile_template(source: str, label: str = "<template>") -> Any:
    """A compiled template from its text; ValueError naming `label` if it does not compile or
    lacks a required block. Compiled once per text: a worker renders every claimed job's
    prompts with it (compiling is ~10 ms, as long as tokenizing a 2k-token document), and a
    compiled template is not changed by rendering."""
    import jinja2

    try:
        tmpl = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"template {label!r} line {e.lineno}: {e.message}") from e
    missing = [b for b in REQUIRED_BLOCKS if b not in tmpl.blocks]
    if missing:
        raise ValueError(f"template {label!r} must define the blocks 'prefix' (instruction + "
                         f"{{{{ document }}}}) and 'question' ({{{{ question }}}}); missing: "
                         f"{', '.join(missing)}")
    return tmpl


def load_template(template: str) -> Any:
    """A compiled template from a built-in name or a path to a `.jinja` file."""
    label, source = template_source(template)
    return compile_template(source, label)


def render_block(tmpl: Any, block: str, context: Mapping[str, Any]) -> str:
    """Render one block of a compiled template with `context`; ValueError whatever goes wrong
    (a user's template can raise anything: `{% include %}` without a loader is a TypeError)."""
    try:
        return "".join(tmpl.blocks[block](tmpl.new_context(dict(context))))
    except Exception as e:  # noqa: BLE001 - a user's template can fail in any way (e.g. include)
        raise ValueError(f"template block {block!r} failed to render: "
                         f"{type(e).__name__}: {e}") from e


def check_template(source: str, label: str = "<template>") -> None:
    """ValueError unless `source` compiles, has both blocks and renders a sample document and
    question, for plain and chat models alike: what ingest can check before a job is queued."""
    tmpl = compile_template(source, label)
    for chat in (False, True):
        context = {"document": "A sample document.", "chat": chat}
        try:
            render_block(tmpl, "prefix", context)
            render_block(tmpl, "question", {**context, "question": "A sample question?",
                                            "index": 0})
            labels = ["yes", "no"]
            with_choices = {**context, "question": "A sample question?", "index": 0,
                            "choices": labels, "letters": choice_letters(len(labels))}
            render_block(tmpl, "question", with_choices)
            for i in range(len(labels)):
                if not choice_text(tmpl, with_choices, i):
                    raise ValueError("the 'choice' block renders an empty text")
        except ValueError as e:
            raise ValueError(f"template {label!r}: {e}") from e
