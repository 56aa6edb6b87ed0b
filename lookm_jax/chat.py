"""Multi-turn chat about pictures on one compressed context, rendered with the chat template.

A `Conversation` encodes and compresses its pictures (and any text before the first question)
once, as the start of the first user turn (`Model.prefill_context`). Each question is the rest of
a user turn, rendered with the model's chat template as `Model.encode_chat` renders a turn, and
prefilled onto the context (`Model.ask(..., extend=True)`): questions and answers join the
context and are never compressed. A refused turn leaves the conversation as it was.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lookm_jax.errors import InputError
from lookm_jax.models.processors import IMAGE_MARKER

# Private-use characters marking where a turn's text is cut out of a rendered template.
_CUT = "\ue000lookm\ue000"


def render(model, messages: list[dict]) -> str:
    """Messages ([{"role", "content"}], the last a user turn) as the model's chat template renders
    them with the assistant's header after; a model without a template concatenates the contents."""
    from lookm_jax.convert.tokenizer import apply_chat_template

    template = model.manifest.get("chat_template")
    if not template:
        return "".join(m["content"] for m in messages)
    return apply_chat_template(template, messages, special_tokens=model.special_tokens)


class Conversation:
    """One conversation (one row) about a compressed context; `ask` answers and extends it.

    context_text: the first user turn's start, with an "<image>" marker per picture (as for
    `Model.encode_chat`; the pictures are `pixel_values`, tiles `image_tiles` for InternVL).
    """

    def __init__(self, model, context_text: str, pixel_values=None, image_tiles: Sequence[int] | None = None, *,
                 method=None, ignore_context_limit: bool = False):
        if not isinstance(context_text, str):
            raise InputError(f"context_text must be a str, got {type(context_text).__name__}")
        if model.tokenizer is None:
            raise InputError("this model has no tokenizer; use Model.prefill_context and Model.ask with ids")
        self.model = model
        self._first = context_text
        self._head = render(model, [{"role": "user", "content": context_text + _CUT}]).split(_CUT)[0]
        ids = np.asarray([model.processor.encode(model.tokenizer, self._head, image_tiles)], np.int32)
        self.context = model.prefill_context(ids, pixel_values, method=method, ignore_context_limit=ignore_context_limit)
        self.messages: list[dict] = []  # the finished turns: user and assistant messages
        self.token_ids: list[int] = ids[0].tolist()  # every token of the conversation so far, in order
        self._ignore_context_limit = ignore_context_limit

    def question_ids(self, question: str) -> list[int]:
        """The next user turn's ids after the conversation so far: its text with the end of the
        turn and the assistant's header (and, after an answer, the template's end of that answer,
        less the answer's own end-of-turn token already generated)."""
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"a question must be non-empty text, got {question!r:.80}")
        if IMAGE_MARKER in question:
            raise InputError(f"a question cannot show pictures ({IMAGE_MARKER}); they belong in the context")
        try:
            question.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InputError(f"the question is not valid Unicode text ({err.reason} at character {err.start})") from None
        if not self.messages:
            whole = render(self.model, [{"role": "user", "content": self._first + question}])
            if not whole.startswith(self._head):
                raise InputError("the chat template renders the question into the context's text; ask it in the prompt")
            text = whole[len(self._head):]
        else:
            previous = self.messages[:-1] + [{"role": "assistant", "content": _CUT}]
            text = render(self.model, previous + [{"role": "user", "content": question}]).split(_CUT)[1]
        ids = self.model.tokenizer.encode(text, add_special_tokens=False).ids
        pending = self.context.pending
        if pending is not None and ids and ids[0] == int(pending[0]):
            ids = ids[1:]  # the answer's end-of-turn token, generated already
        return ids

    def ask(self, question: str, max_new_tokens: int = 48, **kwargs):
        """Answer `question` from the context and the turns so far -> (answer text, `context.Answer`).
        kwargs: temperature, top_p, seed (as for `Model.ask`)."""
        ids = self.question_ids(question)
        pending = self.context.pending
        answer = self.model.ask(self.context, np.asarray([ids], np.int32), max_new_tokens=max_new_tokens,
                                extend=True, ignore_context_limit=self._ignore_context_limit, **kwargs)
        tokens = answer.tokens[0][: int(answer.lengths[0])].tolist()
        text = self.model.decode_text(tokens)
        content = self._first + question if not self.messages else question
        self.messages += [{"role": "user", "content": content}, {"role": "assistant", "content": text}]
        self.token_ids += ([] if pending is None else [int(pending[0])]) + ids + tokens[:-1]
        self.context = answer.context
        return text, answer
