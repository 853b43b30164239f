"""Prompt tokenizers the gateway can use: built-in bytes (shared with the sim engine), an engine's
own ``/tokenize`` (exact for any real model, one loopback round trip), or a local Hugging Face
tokenizer directory with its chat template (needs the optional ``transformers`` package)."""
from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

from engines_adapters.drivers import UpstreamError, UpstreamHTTPError
from engines_adapters.engine_client import EngineClient
from engines_adapters.tokenizer import ByteTokenizer
from gateway.errors import RequestError
from gateway.requests import ParsedRequest, builtin_tokens


class PromptTokenizer(Protocol):
    async def tokens(self, req: ParsedRequest) -> list[int]: ...


class BuiltinTokenizer:
    def __init__(self) -> None:
        self.tok = ByteTokenizer()

    async def tokens(self, req: ParsedRequest) -> list[int]:
        return builtin_tokens(req, self.tok)


class EngineTokenizer:
    """Asks a healthy engine (vLLM ``POST /tokenize`` applies the chat template itself)."""

    def __init__(self, pick_client):
        self.pick_client = pick_client

    async def tokens(self, req: ParsedRequest) -> list[int]:
        client: EngineClient | None = self.pick_client()
        if client is None:
            raise RequestError(503, "no healthy engine to tokenize with", "no_healthy_instance")
        key = "messages" if req.endpoint == "chat" else "prompt"
        try:
            return await client.tokenize({"model": req.model, key: req.body[key]})
        except UpstreamHTTPError as e:
            if e.status < 500:
                why = e.body[:300].decode(errors="replace")
                raise RequestError(400, f"engine could not tokenize the prompt: {why}",
                                   "invalid_prompt") from None
            raise RequestError(502, str(e), "tokenize_failed") from None
        except UpstreamError as e:
            raise RequestError(503, str(e), "tokenize_failed") from None


class HFTokenizer:
    def __init__(self, path: str):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" noise
        try:
            from transformers import AutoTokenizer  # optional: only this mode needs it
        except ImportError:
            raise ValueError("tokenizer 'hf' needs the 'transformers' package (pip install transformers)") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the Hugging Face tokenizer at {path}: {e}") from None

    async def tokens(self, req: ParsedRequest) -> list[int]:
        return await asyncio.to_thread(self._tokens, req)

    def _tokens(self, req: ParsedRequest) -> list[int]:
        try:
            if req.endpoint == "chat":
                # the ids, or (transformers 5) a dict of them
                ids: Any = self.tok.apply_chat_template(req.body["messages"], add_generation_prompt=True, tokenize=True)
                return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            prompt = req.body["prompt"]
            return list(prompt) if isinstance(prompt, list) else list(self.tok.encode(prompt, add_special_tokens=True))
        except Exception as e:  # the template or the prompt is bad: the client's error
            raise RequestError(400, f"cannot tokenize the prompt: {e}", "invalid_prompt") from None
