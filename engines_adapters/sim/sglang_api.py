"""The simulated engine behind SGLang 0.5.23's HTTP surface (``--flavor sglang``), as a router sees it.

Same engine model and OpenAI endpoints as the vLLM surface (:mod:`.api`), plus SGLang's own:
``POST|PUT /generate`` (``text`` or ``input_ids``, ``sampling_params``, ``stream`` with cumulative
chunks, ``meta_info``), ``GET /health`` = ``GET /health_generate`` (answers once the engine made
progress, generating one token when idle, as SGLang does by default), ``GET /model_info`` and
``/server_info`` (with their deprecated ``/get_...`` aliases), ``GET|POST /flush_cache``,
``GET /get_load``, ``GET /metrics`` (``sglang:`` names). No ``/version``: a client tells SGLang
from vLLM by that, as SGLang's own gateway does.

Prefill/decode (``--disaggregation-mode``): requests carry ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` instead of vLLM's ``kv_transfer_params``; the handover is in :mod:`.bootstrap`.
Wire details: docs/protocols.md.
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import msgspec
from aiohttp import web

from scheduler.hashing import block_hashes, namespace_parent

from .api import ApiError, OpenAIApi, ServerInfo, _bool_field, _Gen, _json_response, error_response
from .bootstrap import MAX_ROOM, RoomParams, Rooms, fingerprint
from .driver import EngineDriver, RequestStream
from .model import SimRequest
from .pd import KVParams, KVPuller, _is_loopback

_json = msgspec.json.Encoder()
VERSION = "0.5.23"
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
NO_ROOM = "Invalid request: Disaggregated request received without bootstrap room id."


def _native_error(status: int, message: str, echo: dict | None = None) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": {"message": message}}),
                        content_type="application/json", headers=echo)


class SGLangApi(OpenAIApi):
    def __init__(self, info: ServerInfo, driver: EngineDriver, metrics: Any, puller: KVPuller, *, rooms: Rooms,
                 page_size: int, bootstrap_port: int, server_args: dict[str, Any]):
        super().__init__(info, driver, metrics, puller)
        self.rooms, self.page_size, self.bootstrap_port = rooms, page_size, bootstrap_port
        self.server_args = server_args
        self._started = time.time()
        self._health_seq = 0

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.post("/generate", self.generate),
            web.put("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/flush_cache", self.flush_cache),
            web.post("/flush_cache", self.flush_cache),
            web.get("/get_load", self.get_load),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/metrics", self.metrics_endpoint),
            web.get("/sim/stats", self.stats),
        ]

    # --- server surface ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        i = self.info
        data = [{"id": i.served_name, "object": "model", "created": self._created, "owned_by": "sglang",
                 "root": i.served_name, "max_model_len": i.max_model_len}]
        return _json_response({"object": "list", "data": data})

    def _mode(self) -> str:
        return {"both": "null"}.get(self.info.role, self.info.role)

    async def model_info(self, request: web.Request) -> web.Response:
        i = self.info
        return _json_response({
            "model_path": i.hf_name, "served_model_name": i.served_name, "tokenizer_path": i.hf_name,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": self._mode(), "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.driver.engine
        st = e.stats()
        out = dict(self.server_args)
        out.update(
            model_path=self.info.hf_name, served_model_name=self.info.served_name, tp_size=1, dp_size=1, pp_size=1,
            page_size=self.page_size, disaggregation_mode=self._mode(),
            disaggregation_bootstrap_port=self.bootstrap_port, context_length=self.info.max_model_len,
            max_running_requests=e.max_num_seqs, chunked_prefill_size=e.max_num_batched_tokens,
            max_total_num_tokens=e.kv.capacity * e.block_size, max_req_input_len=self.info.max_model_len - 1,
            launch_command=" ".join(sys.argv), startup_time=self._started, version=VERSION, frontend="python",
            internal_states=[{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": e.max_num_seqs,
                              "memory_usage": {"token_capacity": e.kv.capacity * e.block_size},
                              "num_running_reqs": st.running, "num_queue_reqs": st.waiting}])
        return _json_response(out)

    async def flush_cache(self, request: web.Request) -> web.Response:
        t = request.query.get("timeout", "0")
        try:
            timeout = float(t)
            if not timeout >= 0:
                raise ValueError
        except ValueError:
            return web.Response(status=400, text=f"timeout must be a float >= 0, got {t!r}\n")
        deadline = time.monotonic() + timeout
        while not self.driver.engine.reset_prefix_cache():
            if time.monotonic() >= deadline:
                return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
            await asyncio.sleep(0.05)
        self.driver.kick()  # publishes AllBlocksCleared
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def get_load(self, request: web.Request) -> web.Response:
        e = self.driver.engine
        st = e.stats()
        used = (st.kv_capacity_blocks - st.kv_free_blocks) * e.block_size
        return _json_response([{"dp_rank": 0, "num_reqs": st.running + st.waiting, "num_waiting_reqs": st.waiting,
                                "num_tokens": used}])

    async def health(self, request: web.Request) -> web.Response:
        """200 once the engine shows progress: a step while busy, or a one-token generation."""
        d = self.driver
        steps = d.steps
        self._health_seq += 1
        rid = f"HEALTH_CHECK_{self._health_seq}_{time.monotonic_ns()}"
        st: RequestStream | None = None
        if not d.engine.has_work():
            try:
                st = d.submit(SimRequest(rid, [0], 1, output_len=1))
            except ValueError:
                return web.Response(status=503)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if (st is not None and st.finished is not None) or (st is None and d.steps > steps):
                    return web.Response(status=200)
                await asyncio.sleep(0.005)
            return web.Response(status=503)
        finally:
            if st is not None and st.finished is None:
                d.abort(rid)

    # --- prefill/decode: bootstrap fields instead of kv_transfer_params ------------------------
    def _kv_params(self, body: dict, prompt: list[int]) -> KVParams | None:
        role = self.info.role
        if role == "both":
            return None
        room = body.get("bootstrap_room")
        if room is None:
            raise ApiError(400, NO_ROOM, "bootstrap_room")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
            raise ApiError(400, "bootstrap_room must be an integer in [0, 2^63-1] (batches are not supported "
                                "by the simulated engine)", "bootstrap_room")
        if role == "prefill":
            return RoomParams(do_remote_decode=True, room=room)
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if port is None:
            port = self.bootstrap_port  # SGLang: the receiving server's own --disaggregation-bootstrap-port
        if not isinstance(host, str) or not host:
            raise ApiError(400, "bootstrap_host must be the prefill instance's host", "bootstrap_host")
        if not _is_loopback(host):
            raise ApiError(400, f"bootstrap_host {host!r} is not a loopback address", "bootstrap_host")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ApiError(400, "bootstrap_port must be an integer TCP port or null", "bootstrap_port")
        return RoomParams(do_remote_prefill=True, remote_host=host, remote_port=port, remote_request_id=str(room),
                          room=room, prompt_tokens=len(prompt), fingerprint=fingerprint(prompt))

    def _kv_params_out(self, g: _Gen, rid: str) -> dict | None:
        return None  # SGLang's prefill hands nothing back: the room names the handover

    async def _run(self, request: web.Request, g: _Gen, echo: dict, rid: str | None = None) -> web.StreamResponse:
        kv = g.kv
        if not (isinstance(kv, RoomParams) and kv.do_remote_decode):
            return await super()._run(request, g, echo, rid)
        rid = rid or self._request_id(request)
        if not self.rooms.claim(kv.room, rid, g.prompt):
            msg = f"bootstrap room {kv.room} is already in use by another request on this prefill instance"
            return _native_error(409, msg, echo) if g.native else error_response(409, msg, "bootstrap_room", echo)
        try:
            return await super()._run(request, g, echo, rid)
        finally:  # the prefill request has ended, however: its KV goes (a decode took it, or nobody will)
            if self.driver.engine.held_kv(rid) is not None:
                self.driver.release_kv(rid)
            self.rooms.drop(kv.room, rid)

    async def _before_end(self, g: _Gen, rid: str) -> str | None:
        kv = g.kv
        if not (isinstance(kv, RoomParams) and kv.do_remote_decode):
            return None
        self.rooms.held(kv.room)
        engine = self.driver.engine
        try:
            ok = await self.rooms.wait_released(kv.room, lambda: engine.held_kv(rid) is not None)
        except asyncio.CancelledError:  # the router left: free the KV now
            self.driver.release_kv(rid)
            raise
        if ok:
            return None
        self.driver.release_kv(rid)
        return (f"Prefill transfer failed for request rank=0 req.rid={rid} req.bootstrap_room={kv.room}: no decode "
                f"instance took the KV before the hold expired")

    # --- native /generate ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        ext_id = request.headers.get("X-Request-Id")
        echo = {"X-Request-Id": ext_id} if ext_id else {}
        try:
            body = await self._body(request)
            g = self._parse_native(body)
        except ApiError as e:
            return _native_error(e.status, e.message, echo)
        rid = body.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid or self.driver.engine.has_request(rid)):
            rid = None
        return await self._run(request, g, echo, rid)

    def _parse_native(self, body: dict) -> _Gen:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError(400, "Either text or input_ids should be provided.")
        if text is not None:
            if not isinstance(text, str):
                raise ApiError(400, "batched /generate (a list of texts) is not supported by the simulated engine")
            prompt = self.tok.encode(text)
        else:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(400, "input_ids must be a list of token ids (batches are not supported by the "
                                    "simulated engine)")
            prompt = list(ids)
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object (batches are not supported)")
        if sp.get("n", 1) not in (1, None):
            raise ApiError(400, "only n = 1 is supported by the simulated engine")
        limit, P = self.info.max_model_len, len(prompt)
        if P == 0:
            raise ApiError(400, "The input is empty.")
        mx = sp.get("max_new_tokens", 128)
        if mx is None:
            mx = limit - P
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 0:
            raise ApiError(400, f"max_new_tokens must be a non-negative integer, got {mx!r}")
        if P + mx >= limit + 1 or P >= limit:
            raise ApiError(400, f"Requested token count exceeds the model's maximum context length of {limit} "
                                f"tokens. You requested a total of {P + mx} tokens: {P} tokens from the input "
                                f"messages and {mx} tokens for the completion.")
        try:
            ignore_eos = _bool_field(sp, "ignore_eos")
            stream = _bool_field(body, "stream")
        except ApiError as e:
            raise ApiError(400, e.message) from None
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError(400, "cache_salt must be a non-empty string if provided.")
        kv = self._kv_params(body, prompt)
        if isinstance(kv, RoomParams) and kv.do_remote_decode:
            mx = 1
        return self._namespaced(_Gen(False, prompt, max(1, mx), ignore_eos, stream, False, kv, cache_salt=salt,
                                     native=True), body)

    def _parse(self, body: dict, chat: bool) -> _Gen:
        return self._namespaced(super()._parse(body, chat), body)

    def _namespaced(self, g: _Gen, body: dict) -> _Gen:
        """SGLang's ``extra_key``: requests share cached pages only with the same key (and salt);
        unlike the salt it does not enter the pages' event ids (SGLang recomputes them without it)."""
        key = body.get("extra_key")
        if key is None:
            return g
        if not isinstance(key, str) or not key:
            raise ApiError(400, "extra_key must be a non-empty string if provided.", "extra_key")
        g.block_hashes = block_hashes(g.prompt, self.page_size,
                                      parent=namespace_parent(g.cache_salt, None, ("extra_key", key)))
        return g

    def _meta(self, st: RequestStream, g: _Gen, rid: str, n_out: int, t0: float) -> dict[str, Any]:
        f = st.finished
        cached = f.cached_tokens if f is not None else (st.first.cached_tokens if st.first is not None else 0)
        meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": len(g.prompt),
                                "completion_tokens": n_out, "cached_tokens": cached, "weight_version": "default"}
        if f is not None:
            prefill = isinstance(g.kv, RoomParams) and g.kv.do_remote_decode
            if f.reason == "length" or prefill:
                meta["finish_reason"] = {"type": "length", "length": 0 if prefill else f.output_tokens}
            else:
                meta["finish_reason"] = {"type": "stop", "matched": 0}
            meta["e2e_latency"] = time.monotonic() - t0
        return meta

    async def _native(self, request: web.Request, st: RequestStream, g: _Gen, rid: str,
                      echo: dict) -> web.StreamResponse:
        t0 = time.monotonic()
        out_ids: list[int] = []
        resp: web.StreamResponse | None = None
        while True:
            await st.wait()
            new = bool(st.tokens)
            if new:
                out_ids += st.tokens
                st.tokens = []
            if not g.stream:
                if st.finished is None:
                    continue
                err = await self._before_end(g, rid)
                if err is not None:
                    return _native_error(500, err, echo)
                return _json_response({"text": self.tok.decode(out_ids), "output_ids": out_ids,
                                       "meta_info": self._meta(st, g, rid, len(out_ids), t0)},
                                      self._timing_headers(st, echo))
            if resp is None:
                resp = web.StreamResponse(headers={**self._timing_headers(st, echo),
                                                   "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
            if st.finished is not None:
                err = await self._before_end(g, rid)
                if err is not None:
                    chunk: dict[str, Any] = {"error": {"message": err, "type": "invalid_request_error", "code": 500,
                                                     "retryable": False}}
                else:
                    chunk = {"text": self.tok.decode(out_ids), "output_ids": out_ids,
                             "meta_info": self._meta(st, g, rid, len(out_ids), t0)}
                await resp.write(b"data: " + _json.encode(chunk) + b"\n\ndata: [DONE]\n\n")
                break
            if new:  # cumulative, as SGLang streams without --incremental-streaming-output
                chunk = {"text": self.tok.decode(out_ids), "output_ids": out_ids,
                         "meta_info": self._meta(st, g, rid, len(out_ids), t0)}
                await resp.write(b"data: " + _json.encode(chunk) + b"\n\n")
        await resp.write_eof()
        return resp
