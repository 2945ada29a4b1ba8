"""A chat request's prompt as text: the model's chat template over its messages, plus where each
message starts in that text (the places a prompt can be split into a document and the rest).

With a chat template (`Tokenizer.render_messages`), message k starts where the rendering of the
first k messages ends; a position counts only if that rendering is a true prefix of the whole
(templates that insert text depending on later messages give fewer split points). A tokenizer
without one (the `dummy:` models' bytes, base models) gets `PLAIN_FORMAT`: "Role: text" blocks
and an "Assistant:" cue, whose message starts are known exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppqa.openai.chat_request import RequestError

PLAIN_FORMAT = "{role}: {content}\n\n"
PLAIN_CUE = "Assistant:"


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    # Offsets in `text` where message 1, 2, ... begin, then where the assistant's turn begins
    # (the generation prompt), ascending; message 0 starts the text.
    message_starts: tuple[int, ...]

    @property
    def last_message_start(self) -> int | None:
        """Where the request's last message begins (None: one message, or unknown)."""
        return self.message_starts[-2] if len(self.message_starts) >= 2 else None

    @property
    def generation_start(self) -> int | None:
        return self.message_starts[-1] if self.message_starts else None


def render_prompt(tokenizer, messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
    """The prompt of `messages` ((role, text) pairs) for `tokenizer`'s model."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _render_plain(messages)
    dicts = [{"role": role, "content": text} for role, text in messages]
    try:
        text = tokenizer.render_messages(dicts, add_generation_prompt=True)
        starts = []
        for k in range(1, len(dicts) + 1):
            head = tokenizer.render_messages(dicts[:k], add_generation_prompt=False)
            if text.startswith(head) and 0 < len(head) < len(text):
                starts.append(len(head))
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja, ValueError)
        raise RequestError(f"the model's chat template cannot render these messages: {exc}",
                           "messages") from None
    return RenderedPrompt(text, tuple(sorted(set(starts))))


def _render_plain(messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
    parts, starts, offset = [], [], 0
    for i, (role, content) in enumerate(messages):
        if i:
            starts.append(offset)
        block = PLAIN_FORMAT.format(role=role.capitalize(), content=content)
        parts.append(block)
        offset += len(block)
    starts.append(offset)
    return RenderedPrompt("".join(parts) + PLAIN_CUE, tuple(starts))
