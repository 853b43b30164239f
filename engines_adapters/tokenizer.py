"""The built-in deterministic tokenizer and chat template, shared by the sim engine, the gateway
and the load generator so all three produce identical token ids.

Byte-level: a text's tokens are its UTF-8 bytes (N ASCII characters are N tokens, ids 0..255).
The chat template renders each message as ``<|role|>\\n{content}\\n`` and, with
``add_generation_prompt`` (the default), appends ``<|assistant|>\\n``. Content given as a list of
parts (OpenAI's ``[{"type": "text", "text": ...}]``) is joined from its text parts.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 256


class ChatTemplateError(ValueError):
    """A chat message the template cannot render (bad role or content)."""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


class ByteTokenizer:
    """Byte-level tokenizer with the documented chat template."""

    name = "builtin-bytes"
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"messages[{i}] must be an object")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
            out.append(f"<|{role}|>\n{_content_text(m.get('content'))}\n")
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A completions ``prompt``: a string or a list of token ids (batched prompts are refused)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
                raise ChatTemplateError(f"token ids must be in [0, {VOCAB_SIZE})")
            return list(prompt)
        raise ChatTemplateError("prompt must be a string or a list of token ids")
