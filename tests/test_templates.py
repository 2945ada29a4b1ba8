"""Prompt templates: the built-in ones render both parts; user templates render in a sandbox."""

from __future__ import annotations

import pytest

from ppqa.engine.loading.tokenizer import ByteTokenizer
from ppqa.templates import list_templates, load_template, render_block

DOC = "Alice paid Bob 30 euros on Monday."


def test_builtin_templates_exist():
    assert {"qa", "multiple_choice", "label", "judge"} <= set(list_templates())


@pytest.mark.parametrize("name", ["qa", "multiple_choice", "label", "judge"])
def test_builtin_template_parts(name):
    tmpl = load_template(name)
    for chat in (False, True):
        context = {"document": DOC, "chat": chat}
        prefix = render_block(tmpl, "prefix", context)
        question = render_block(tmpl, "question", {**context, "question": "Who paid?", "index": 0})
        assert prefix.endswith("Document:\n" + DOC) and "Who paid?" not in prefix
        assert question.startswith("\n\n") and "Who paid?" in question and DOC not in question
        # Plain-text models get an answer cue; chat models get it from the assistant turn.
        assert question.rstrip().endswith(":") != chat


def test_label_template_lists_the_labels():
    tok = ByteTokenizer(384)
    prompt = tok.prompt("label", DOC, ["Which currency?"], variables={"labels": ["EUR", "USD"]})
    assert "chosen from: EUR, USD." in tok.decode(prompt.prefix_ids)
    plain = tok.prompt("label", DOC, ["Which currency?"])
    assert "chosen from" not in tok.decode(plain.prefix_ids)


def test_user_template_from_path(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% block prefix %}DOC[{{ document }}]{% endblock %}"
                    "{% block question %}Q{{ index }}[{{ question | upper }}]{% endblock %}")
    tok = ByteTokenizer(384)
    prompt = tok.prompt(str(path), "d", ["a", "b"])
    assert tok.decode(prompt.prefix_ids) == "DOC[d]"
    assert [tok.decode(s) for s in prompt.suffix_ids] == ["Q0[A]", "Q1[B]"]


def test_user_template_runs_in_the_sandbox(tmp_path):
    path = tmp_path / "evil.jinja"
    path.write_text("{% block prefix %}{{ document.__class__.__mro__[1].__subclasses__() }}"
                    "{% endblock %}{% block question %}{{ question }}{% endblock %}")
    with pytest.raises(ValueError, match="failed to render"):
        ByteTokenizer(384).prompt(str(path), "d", ["q"])


def test_user_template_errors_are_clear(tmp_path):
    no_blocks = tmp_path / "flat.jinja"
    no_blocks.write_text("{{ document }} {{ question }}")
    with pytest.raises(ValueError, match="missing: prefix, question"):
        load_template(str(no_blocks))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% block prefix %}{{ document {% endblock %}")
    with pytest.raises(ValueError, match="line 1"):
        load_template(str(bad))
    with pytest.raises(ValueError, match="cannot read template"):
        load_template(str(tmp_path / "absent.jinja"))


def test_a_template_file_is_compiled_once_per_text(tmp_path):
    """A worker loads the template of every job it claims: the same text gives the same
    compiled template, and an edited file is read and compiled afresh."""
    path = tmp_path / "mine.jinja"
    body = "{% block question %}Q: {{ question }}{% endblock %}"
    path.write_text("{% block prefix %}Doc: {{ document }}{% endblock %}" + body)
    first = load_template(str(path))
    assert load_template(str(path)) is first
    path.write_text("{% block prefix %}Text: {{ document }}{% endblock %}" + body)
    edited = load_template(str(path))
    assert edited is not first
    assert render_block(edited, "prefix", {"document": DOC}) == "Text: " + DOC
    assert render_block(first, "prefix", {"document": DOC}) == "Doc: " + DOC
