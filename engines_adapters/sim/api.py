"""The OpenAI-compatible and vLLM-specific HTTP surface of the simulated engine (aiohttp).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as SSE or not),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``,
``GET /version``, ``POST /reset_prefix_cache``, the PD endpoints ``POST /kv/pull`` and
``POST /kv/release`` (see pd.py), and
``GET /sim/stats`` (the engine's load facts as JSON; not part of vLLM).

Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.
A client that disconnects aborts its request (the server runs with handler cancellation), which
frees its KV. Responses echo ``X-Request-Id`` and carry the modelled ``x-sim-queue-ms``,
``x-sim-prefill-ms``, ``x-sim-transfer-ms`` and ``x-sim-cached-tokens`` (on streams they are sent
with the first token).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ..tokenizer import ByteTokenizer, ChatTemplateError
from .driver import EngineDriver, RequestStream
from .metrics import Metrics
from .model import SimRequest
from .pd import KVParams, KVParamsError, KVPuller, PullError, parse_kv_params, prefill_response_params
from .store_link import StoreLink

_json = msgspec.json.Encoder()
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 410: "GoneError",
                500: "InternalServerError", 502: "BadGatewayError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   err_type: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}
    return web.Response(status=status, body=_json.encode(body), content_type="application/json",
                        headers=headers)


def _json_response(obj: Any, headers: dict | None = None, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(obj), content_type="application/json", headers=headers)


@dataclass
class ServerInfo:
    host: str
    port: int
    role: str
    served_name: str
    hf_name: str
    max_model_len: int
    engine_id: str
    aliases: tuple[str, ...] = ()  # more --served-model-name values (vLLM answers to each)
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules name=path (a cache namespace each)


@dataclass
class _Gen:
    """A validated generation request."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    kv: KVParams | None
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter the request names as its model
    native: bool = False  # SGLang's /generate (its own response shape)
    block_hashes: list[int] | None = None  # the prompt's cache keys when a flavour namespaces them itself


def _int_field(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{key}' must be an integer", key)
    if v < 1:
        raise ApiError(400, f"'{key}' must be at least 1, got {v}", key)
    return v


def _bool_field(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a boolean", key)
    return v


class OpenAIApi:
    def __init__(self, info: ServerInfo, driver: EngineDriver, metrics: Metrics, puller: KVPuller,
                 store: StoreLink | None = None):
        self.info = info
        self.driver = driver
        self.metrics = metrics
        self.puller = puller
        self.store = store  # the shared KV store connector (--kv-store), or None
        self.tok = ByteTokenizer()
        self._names = {info.served_name, info.hf_name, *info.aliases}
        self._remote: dict[str, KVParams] = {}  # decode requests whose prefill still holds KV
        self._created = int(time.time())
        driver.on_kv_loaded = self._kv_loaded

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/metrics", self.metrics_endpoint),
            web.get("/version", self.version),
            web.post("/kv/pull", self.kv_pull),
            web.post("/kv/release", self.kv_release),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.get("/sim/stats", self.stats),
        ]

    # --- small endpoints --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json_response({"version": "0.33.0", "engine": "conductor-sim"})

    async def models(self, request: web.Request) -> web.Response:
        i = self.info
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": self._created, "owned_by": "vllm",
             "root": i.hf_name, "parent": None, "max_model_len": i.max_model_len, "permission": []}
            for name in (i.served_name, *i.aliases)]
        data += [{"id": name, "object": "model", "created": self._created, "owned_by": "vllm", "root": path,
                  "parent": i.served_name, "max_model_len": i.max_model_len, "permission": []}
                 for name, path in i.lora_modules.items()]  # vLLM lists adapters with their base as parent
        return _json_response({"object": "list", "data": data})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def stats(self, request: web.Request) -> web.Response:
        st = self.driver.engine.stats()
        out = {f: getattr(st, f) for f in st.__dataclass_fields__}
        out.update(role=self.info.role, steps=self.driver.steps, busy_s=self.driver.busy_s, lag_s=self.driver.lag_s,
                   modelled_time_s=self.driver.wall_model_time())
        return _json_response(out)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            self._check_model(body)
            ids = self._prompt_ids(body, chat="messages" in body)
        except ApiError as e:
            return error_response(e.status, e.message, e.param)
        return _json_response({"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids,
                               "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < 256 for t in toks):
                raise ApiError(400, "'tokens' must be a list of token ids in [0, 256)", "tokens")
        except ApiError as e:
            return error_response(e.status, e.message, e.param)
        return _json_response({"prompt": self.tok.decode(toks)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.driver.engine.reset_prefix_cache():
            return error_response(409, "cannot reset the prefix cache while requests hold KV")
        self.driver.kick()  # publishes AllBlocksCleared
        return web.Response(status=200)

    # --- PD endpoints (prefill side) --------------------------------------------------------
    async def kv_pull(self, request: web.Request) -> web.Response:
        try:
            rid = self._remote_id(await self._body(request))
        except ApiError as e:
            return error_response(e.status, e.message, e.param)
        held = self.driver.engine.held_kv(rid)
        if held is None:
            return error_response(404, f"no KV held for request {rid!r}", "remote_request_id")
        eng = self.driver.engine
        return _json_response({"remote_request_id": rid, "num_tokens": held.num_tokens,
                               "num_blocks": held.num_blocks, "block_size": held.block_size,
                               "kv_bytes": held.num_tokens * eng.profile.kv_bytes_per_token,
                               "expires_in_s": max(0.0, held.expires_at - self.driver.now())})

    async def kv_release(self, request: web.Request) -> web.Response:
        try:
            rid = self._remote_id(await self._body(request))
        except ApiError as e:
            return error_response(e.status, e.message, e.param)
        if not self.driver.release_kv(rid):
            return error_response(404, f"no KV held for request {rid!r}", "remote_request_id")
        return _json_response({"released": True, "remote_request_id": rid})

    @staticmethod
    def _remote_id(body: dict) -> str:
        rid = body.get("remote_request_id")
        if not isinstance(rid, str) or not rid:
            raise ApiError(400, "'remote_request_id' must be a non-empty string", "remote_request_id")
        return rid

    def _kv_loaded(self, request_id: str) -> None:
        p = self._remote.pop(request_id, None)
        if p is not None:
            self.puller.release(p)

    # --- generation -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> str | None:
        """The LoRA adapter the request names (None: a base model name or none)."""
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model in self.info.lora_modules:
            return model
        if model not in self._names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return None

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        try:
            if chat:
                if "messages" not in body:
                    raise ApiError(400, "'messages' is a required field", "messages")
                agp = _bool_field(body, "add_generation_prompt", True)
                return self.tok.encode_chat(body["messages"], add_generation_prompt=agp)
            if "prompt" not in body:
                raise ApiError(400, "'prompt' is a required field", "prompt")
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            return self.tok.encode_prompt(prompt)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None

    def _parse(self, body: dict, chat: bool) -> _Gen:
        lora = self._check_model(body)
        prompt = self._prompt_ids(body, chat)
        n = body.get("n", 1)
        if n not in (1, None):
            raise ApiError(400, "only n = 1 is supported by the simulated engine", "n")
        max_tokens = _int_field(body, "max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens")
        limit = self.info.max_model_len
        P = len(prompt)
        if P == 0:
            raise ApiError(400, "the prompt is empty", "messages" if chat else "prompt")
        if P >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                                f"has {P} input tokens. Please reduce the length of the input.",
                           "messages" if chat else "prompt")
        if max_tokens is None:
            max_tokens = limit - P
        elif P + max_tokens > limit:
            raise ApiError(400, f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
                                f"is {limit} tokens and your request has {P} input tokens "
                                f"({max_tokens} > {limit} - {P}).", "max_tokens")
        stream = _bool_field(body, "stream")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        include_usage = _bool_field(so or {}, "include_usage")
        kv = self._kv_params(body, prompt)
        if kv is not None:
            if kv.do_remote_decode and self.info.role == "decode":
                raise ApiError(400, "this is a decode instance: it cannot serve do_remote_decode", "kv_transfer_params")
            if kv.do_remote_prefill and self.info.role == "prefill":
                raise ApiError(400, "this is a prefill instance: it cannot serve do_remote_prefill",
                               "kv_transfer_params")
            if kv.do_remote_decode:
                max_tokens = 1
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):  # vLLM's own check and message
            raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        return _Gen(chat, prompt, max_tokens, _bool_field(body, "ignore_eos"), stream, include_usage, kv, salt, lora)

    def _kv_params(self, body: dict, prompt: list[int]) -> KVParams | None:
        """The request's PD role (vLLM: ``kv_transfer_params``); a flavour overrides this."""
        try:
            return parse_kv_params(body.get("kv_transfer_params"))
        except KVParamsError as e:
            raise ApiError(400, str(e), "kv_transfer_params") from None

    async def _before_end(self, g: _Gen, rid: str) -> str | None:
        """Runs when the request finished, before its last bytes go out; an error message ends
        it as failed instead (SGLang's prefill answers only once its KV was handed over)."""
        return None

    def _request_id(self, request: web.Request) -> str:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if self.driver.engine.has_request(rid):  # a duplicate id still in flight: keep ids unique
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        return rid

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        ext_id = request.headers.get("X-Request-Id")
        echo = {"X-Request-Id": ext_id} if ext_id else {}
        try:
            g = self._parse(await self._body(request), chat)
        except ApiError as e:
            return error_response(e.status, e.message, e.param, echo)
        return await self._run(request, g, echo)

    async def _run(self, request: web.Request, g: _Gen, echo: dict, rid: str | None = None) -> web.StreamResponse:
        """Pull the prompt's KV when the request asks (PD decode side), run it, answer it."""
        rid = rid or self._request_id(request)
        kv = g.kv if g.kv is not None and g.kv.do_remote_prefill else None  # what the pull names
        if kv is not None:
            try:
                meta = await self.puller.pull(kv)
            except PullError as e:
                return error_response(e.status, str(e), "kv_transfer_params", echo, err_type=e.code)
            except asyncio.CancelledError:  # the client left during the pull: free the prefill's KV now
                self.puller.release(kv)
                raise
            if not isinstance(meta, dict):
                self.puller.release(kv)
                return error_response(502, "the prefill instance answered the pull with no JSON object",
                                      "kv_transfer_params", echo)
            if meta.get("num_tokens") != len(g.prompt):
                self.puller.release(kv)
                return error_response(409, f"the prefill instance holds KV for {meta.get('num_tokens')} tokens but "
                                           f"this prompt has {len(g.prompt)}", "kv_transfer_params", echo)
        req = SimRequest(rid, g.prompt, g.max_tokens, output_len=g.max_tokens if g.ignore_eos else None,
                         hold_kv=bool(g.kv and g.kv.do_remote_decode), remote_kv=kv is not None,
                         cache_salt=g.cache_salt, lora_name=g.lora, block_hashes=g.block_hashes)
        if self.store is not None and kv is None:  # (a salt or adapter: the namespace's own keys)
            req.store_blocks, req.store_fetched, req.store_load_s = await self.store.prefetch(
                g.prompt, g.cache_salt or None, req.lora_name or None)
        try:
            st = self.driver.submit(req)
        except ValueError as e:
            if kv is not None:
                self.puller.release(kv)
            return error_response(400, str(e), None, echo)
        if kv is not None:
            self._remote[rid] = kv
        try:
            if g.native:
                return await self._native(request, st, g, rid, echo)
            if g.stream:
                return await self._stream(request, st, g, rid, echo)
            return await self._complete(st, g, rid, echo)
        finally:
            if st.finished is None:
                self.driver.abort(rid)
            p = self._remote.pop(rid, None)
            if p is not None:
                self.puller.release(p)

    async def _native(self, request: web.Request, st: RequestStream, g: _Gen, rid: str,
                      echo: dict) -> web.StreamResponse:
        return error_response(404, "/generate is SGLang's native API: run the engine with --flavor sglang", None, echo)

    def _usage(self, st: RequestStream) -> dict:
        f = st.finished
        assert f is not None  # called once the request finished
        return {"prompt_tokens": f.prompt_tokens, "total_tokens": f.prompt_tokens + f.output_tokens,
                "completion_tokens": f.output_tokens, "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}

    @staticmethod
    def _timing_headers(st: RequestStream, echo: dict) -> dict:
        h = dict(echo)
        ft = st.first
        if ft is not None:
            h["x-sim-queue-ms"] = f"{(ft.scheduled - ft.arrival) * 1e3:.3f}"
            h["x-sim-transfer-ms"] = f"{ft.transfer_s * 1e3:.3f}"
            h["x-sim-prefill-ms"] = f"{max(0.0, ft.first_token - ft.scheduled - ft.transfer_s) * 1e3:.3f}"
            h["x-sim-cached-tokens"] = str(ft.cached_tokens)
        return h

    def _kv_params_out(self, g: _Gen, rid: str) -> dict | None:
        if g.kv is not None and g.kv.do_remote_decode:
            i = self.info
            return prefill_response_params(i.host, i.port, rid, i.engine_id)
        return None

    async def _complete(self, st: RequestStream, g: _Gen, rid: str, echo: dict) -> web.Response:
        tokens: list[int] = []
        while True:
            await st.wait()
            if st.tokens:
                tokens += st.tokens
                st.tokens = []
            if st.finished is not None:
                break
        err = await self._before_end(g, rid)
        if err is not None:
            return error_response(500, err, None, echo)
        f = st.finished
        assert f is not None  # the loop above ends on it
        text = self.tok.decode(tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": f.reason, "stop_reason": None}
        if g.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            body: dict[str, Any] = {"id": f"chatcmpl-{rid}", "object": "chat.completion"}
        else:
            choice["text"] = text
            body = {"id": f"cmpl-{rid}", "object": "text_completion"}
        body.update(created=int(time.time()), model=g.lora or self.info.served_name, choices=[choice],
                    usage=self._usage(st))
        kvp = self._kv_params_out(g, rid)
        if kvp is not None:
            body["kv_transfer_params"] = kvp
        if f.store_tokens:  # what the store connector loaded (a router can show it; others ignore it)
            body["kv_store"] = {"loaded_tokens": f.store_tokens, "load_s": f.transfer_s}
        return _json_response(body, self._timing_headers(st, echo))

    async def _stream(self, request: web.Request, st: RequestStream, g: _Gen, rid: str,
                      echo: dict) -> web.StreamResponse:
        created = int(time.time())
        model = g.lora or self.info.served_name  # vLLM answers with the adapter's name for a LoRA request
        jm = _json.encode(model).decode()  # ids and names are JSON-escaped: X-Request-Id is client input
        if g.chat:
            jid = _json.encode(f"chatcmpl-{rid}").decode()
            head = (f'data: {{"id":{jid},"object":"chat.completion.chunk","created":{created},'
                    f'"model":{jm},"choices":[{{"index":0,').encode()
            content_open, content_close = b'"delta":{"content":', b'},"logprobs":null,"finish_reason":null}]}\n\n'
            first_chunk = (head + b'"delta":{"role":"assistant","content":""},'
                           b'"logprobs":null,"finish_reason":null}]}\n\n')
        else:
            jid = _json.encode(f"cmpl-{rid}").decode()
            head = (f'data: {{"id":{jid},"object":"text_completion","created":{created},'
                    f'"model":{jm},"choices":[{{"index":0,').encode()
            content_open, content_close = b'"text":', b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            first_chunk = b""
        resp: web.StreamResponse | None = None
        while True:
            await st.wait()
            out = b""
            if st.tokens:
                toks, st.tokens = st.tokens, []
                out = head + content_open + _json.encode(self.tok.decode(toks)) + content_close
            if resp is None:
                resp = web.StreamResponse(headers={**self._timing_headers(st, echo),
                                                   "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                out = first_chunk + out
            if st.finished is not None:
                err = await self._before_end(g, rid)
                if err is not None:
                    out += b"data: " + _json.encode({"error": {"message": err, "type": "InternalServerError",
                                                               "code": 500}}) + b"\n\ndata: [DONE]\n\n"
                else:
                    out += self._final_chunks(st, g, rid, created, model)
                await resp.write(out)
                break
            if out:
                await resp.write(out)
        await resp.write_eof()
        return resp

    def _final_chunks(self, st: RequestStream, g: _Gen, rid: str, created: int, model: str) -> bytes:
        f = st.finished
        assert f is not None  # called once the request finished
        base = {"id": f"{'chatcmpl' if g.chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if g.chat else "text_completion", "created": created,
                "model": model}
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": f.reason, "stop_reason": None}
        if g.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        last: dict[str, Any] = {**base, "choices": [choice]}
        kvp = self._kv_params_out(g, rid)
        if kvp is not None:
            last["kv_transfer_params"] = kvp
        out = b"data: " + _json.encode(last) + b"\n\n"
        if g.include_usage:
            out += b"data: " + _json.encode({**base, "choices": [], "usage": self._usage(st)}) + b"\n\n"
        return out + b"data: [DONE]\n\n"
