"""Chat records: OpenAI ``messages`` (the fine-tuning format) rendered with the model's chat template.

A chat record ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``
becomes a :class:`~scpdr.data.records.Record` whose ``prompt`` is the tokenizer's chat template of
every message but the last with the generation prompt, whose ``response`` is the rest of the
template of the whole conversation (the last, assistant, message and its end-of-turn), and whose
``text = prompt + response`` is what a constituent is trained on. ``scpdr serve``'s chat endpoint
(:func:`scpdr.serve.chat.chat_prompt`) applies the same template to the same messages with the
generation prompt, so what is served is what was learned. "developer" is sent as "system", as the
server does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from scpdr.data.formats import DataError

__all__ = ["ChatTemplate", "check_messages"]

_ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` ("developer" → "system"); the last must be the
    assistant's (the response that is learned). Raises :class:`DataError` naming ``where``."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: message {i} is not an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise DataError(f"{where}: message {i} has role {role!r}; use one of {list(_ROLES)}")
        if isinstance(content, list):  # the content-parts form: text parts only
            texts = [p.get("text") for p in content if isinstance(p, Mapping)]
            if any(not isinstance(t, str) for t in texts) or not texts:
                raise DataError(f"{where}: message {i} has non-text content parts")
            content = "".join(texts)
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} content must be a string")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if out[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message must be the assistant's (what the model learns to say); "
            f"got {out[-1]['role']!r}"
        )
    return out


class ChatTemplate:
    """Renders chat records with the chat template of a tokenizer (loaded on first use).

    Args:
        tokenizer: a tokenizer, or a model ref whose tokenizer to load (``"embedded"``: the
            embedded SmolLM2-135M-Instruct, a model directory).
    """

    def __init__(self, tokenizer: Any = "embedded") -> None:
        self._tok = None if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        self._ref = None if self._tok is not None else os.fspath(tokenizer)

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            from scpdr.models import load_tokenizer

            self._tok = load_tokenizer(self._ref)
        return self._tok

    def render(self, messages: Any, *, where: str = "chat record") -> tuple[str, str]:
        """``(prompt, response)`` of one conversation (see the module docstring)."""
        conv = check_messages(messages, where)
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{where}: a chat record needs a tokenizer with a chat template, and "
                f"{self._ref or 'this tokenizer'} has none; train on text records (--text-field) "
                "or choose a base model with a chat template"
            )
        prompt = tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(conv, tokenize=False)
        if not full.startswith(prompt) or len(full) == len(prompt):
            raise DataError(
                f"{where}: the chat template does not render the conversation as its prompt "
                "followed by the assistant's reply; train on text records instead"
            )
        return prompt, full[len(prompt) :]

    def __call__(self, messages: Any, *, where: str = "chat record") -> tuple[str, str]:
        return self.render(messages, where=where)
