"""Prompt synthesis: request bodies whose token blocks reproduce a trace's prefix sharing.

Each block id gets a deterministic 512-character ASCII text (one token per character under the
built-in byte tokenizer): 8 characters encoding the id (so different ids always give different
blocks), then characters drawn from BLAKE2b keyed by the salt and the id. A prompt is its blocks
concatenated and cut to ``input_length``, so equal ids give identical blocks and the last partial
block is a prefix of its full text. Block i depends only on hash_ids[i].

Exactness, by endpoint and prompt format:

* ``completions`` + ``text``: the prompt is the text; ``input_length`` tokens and 512-token
  boundaries are exact with the built-in tokenizer.
* ``completions`` + ``token-ids``: the prompt is the same characters' byte values as token ids
  (32..122, ordinary tokens in common vocabularies): exact under *any* tokenizer.
* ``chat`` (default): the server wraps the message in its chat template. For the built-in template
  the header (``<|user|>\\n``, 9 tokens) replaces the first 9 tokens of block 0 and the trailer
  (``\\n<|assistant|>\\n``, 15 tokens) the last 15 of the partial final block, so the templated
  prompt has exactly ``input_length`` tokens and every 512-token boundary stays in place: full
  blocks are identical for equal ids. When the partial block is shorter than the trailer (or
  absent), the trailer replaces it instead, so no full block is touched and the prompt is up to
  14 tokens longer than ``input_length`` (2.6% of the Mooncake conversation trace; the real
  count is returned and reported).
* Any other tokenizer with text prompts: lengths are approximate (a BPE tokenizer merges these
  characters into fewer tokens); the run measures the difference from ``usage.prompt_tokens``
  and reports it (``prompt_tokens`` in the summary).

A salt changes every block's text (not the sharing pattern), so repeated steps of a sweep do not
hit each other's cache.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from engines_adapters.tokenizer import ByteTokenizer

from .workload import MAX_HASH_ID, TRACE_BLOCK_TOKENS, Request

#: 64 printable ASCII characters, none of ``<|>`` or newline (the template's markers).
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 ."
_TO_ALPHABET = bytes.maketrans(bytes(range(256)), (ALPHABET * 4).encode())
ID_CHARS = 8  # base-64 digits of the block id at the start of each block
MAX_BLOCK_ID = MAX_HASH_ID  # = 64**ID_CHARS - 1

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PROMPT_FORMATS = ("text", "token-ids")


def _id_header(hash_id: int) -> str:
    if not 0 <= hash_id <= MAX_BLOCK_ID:
        raise ValueError(f"block id {hash_id} outside [0, 64**{ID_CHARS})")
    out = []
    for _ in range(ID_CHARS):
        hash_id, d = divmod(hash_id, 64)
        out.append(ALPHABET[d])
    return "".join(out)


class PromptSynth:
    """Deterministic block texts (cached) and prompts built from them."""

    def __init__(self, block_tokens: int = TRACE_BLOCK_TOKENS, salt: str = ""):
        if block_tokens <= ID_CHARS:
            raise ValueError(f"block_tokens must be > {ID_CHARS}")
        self.block_tokens = block_tokens
        self.salt = salt
        self._key = hashlib.blake2b(salt.encode(), digest_size=32).digest()
        self._cache: dict[int, str] = {}

    def block_text(self, hash_id: int) -> str:
        text = self._cache.get(hash_id)
        if text is None:
            body = bytearray()
            need, counter = self.block_tokens - ID_CHARS, 0
            while len(body) < need:
                body += hashlib.blake2b(f"{hash_id}:{counter}".encode(), key=self._key, digest_size=64).digest()
                counter += 1
            text = _id_header(hash_id) + bytes(body[:need]).translate(_TO_ALPHABET).decode()
            self._cache[hash_id] = text
        return text

    def text(self, hash_ids: tuple[int, ...] | list[int], length: int) -> str:
        """``length`` characters: the blocks of ``hash_ids`` in order, the last one cut."""
        if length > len(hash_ids) * self.block_tokens:
            raise ValueError(f"{len(hash_ids)} blocks cannot hold {length} tokens")
        n = -(-length // self.block_tokens)
        return "".join(self.block_text(h) for h in hash_ids[:n])[:length]


@dataclass(frozen=True)
class ChatFraming:
    """What a chat template adds around one user message: header and trailer text."""

    header: str
    trailer: str

    @classmethod
    def of(cls, tokenizer=None) -> "ChatFraming":
        tok = tokenizer or ByteTokenizer()
        mark = "\x00MARK\x00"
        rendered = tok.apply_chat_template([{"role": "user", "content": mark}])
        header, _, trailer = rendered.partition(mark)
        return cls(header, trailer)


@dataclass
class Prompt:
    """The prompt part of a body and its token count under the built-in tokenizer."""

    fields: dict[str, Any]
    tokens: int


def build_prompt(req: Request, synth: PromptSynth, endpoint: str = "chat", prompt_format: str = "text",
                 framing: ChatFraming | None = None) -> Prompt:
    """``messages`` or ``prompt`` for one request, ``input_length`` tokens long when possible.

    In chat mode a prompt shorter than the template's own overhead (+1 character) cannot be
    exact: it is sent with one character of content and its real length is returned.
    """
    n = req.input_length
    full = synth.text(req.hash_ids, n)
    if endpoint == "chat":
        if prompt_format != "text":
            raise ValueError("token-id prompts need the completions endpoint")
        f = framing or ChatFraming.of()
        h, t = len(f.header), len(f.trailer)
        tail = n % synth.block_tokens
        if tail >= t or n < synth.block_tokens:
            end = n - t  # the trailer fits in the partial last block: exact length
        else:
            # it would reach back into a full block, which another request may share: keep full
            # blocks whole and let the trailer replace the short tail (up to t - 1 extra tokens)
            end = n - tail
        content = full[h:end] if end > h else full[:1]
        return Prompt({"messages": [{"role": "user", "content": content}]}, h + len(content) + t)
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}")
    if prompt_format == "token-ids":
        return Prompt({"prompt": list(full.encode())}, n)
    return Prompt({"prompt": full}, n)


def build_body(req: Request, synth: PromptSynth, *, model: str, endpoint: str = "chat",
               prompt_format: str = "text", framing: ChatFraming | None = None) -> tuple[dict[str, Any], int]:
    """A streaming request body with the output forced to ``output_length`` tokens, and its
    prompt token count."""
    p = build_prompt(req, synth, endpoint, prompt_format, framing)
    body = {"model": model, **p.fields, "max_tokens": req.output_length, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return body, p.tokens
