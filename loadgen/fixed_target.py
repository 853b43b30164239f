"""A fixed-latency OpenAI-compatible target: the load generator's calibration reference.

Every streamed answer has a known shape: headers and a role-only chunk at once, the first token
``ttft`` after arrival (plus the wait for a prefill slot when ``prefill_slots`` caps them, a
queue whose TTFT grows with load), then one token every ``itl`` on absolute deadlines (no drift),
a finish chunk, a ``usage`` chunk (prompt tokens counted with the built-in tokenizer) and
``[DONE]``. Optional admission (429 beyond ``max_inflight``, with ``Retry-After`` and
``x-conductor-reject-reason``), injected errors, and an early stop without ``ignore_eos`` make
every path of the runner observable. Binds to loopback by default.

    python -m loadgen.fixed_target --port 8100 --ttft-ms 50 --itl-ms 10
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from engines_adapters.tokenizer import ByteTokenizer, ChatTemplateError


@dataclass
class TargetConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    model: str = "fixed-model"
    prefill_slots: int | None = None  # concurrent prefills; None = unlimited
    max_inflight: int | None = None  # answer 429 beyond this many requests in flight
    eos_after: int | None = None  # without ignore_eos, stop after this many tokens
    error_every: int | None = None  # answer HTTP 500 to every n-th request
    usage: bool = True  # send the usage chunk when asked for it
    prefill_name: str = "prefill-0"
    decode_name: str = "decode-0"
    retry_after_s: int = 1
    api_key: str | None = None  # when set, answer 401 without "authorization: Bearer KEY"
    never_stream: bool = False  # answer whole JSON even when asked to stream (some servers do)


class FixedTarget:
    def __init__(self, cfg: TargetConfig):
        self.cfg = cfg
        self.tok = ByteTokenizer()
        self.inflight = 0
        self.count = 0
        self.prefill = asyncio.Semaphore(cfg.prefill_slots) if cfg.prefill_slots else None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        return app

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.cfg.api_key and request.headers.get("authorization") != f"Bearer {self.cfg.api_key}":
            return self._error(401, "missing or wrong API key")
        return await handler(request)

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]})

    async def chat(self, req: web.Request) -> web.StreamResponse:
        return await self.answer(req, chat=True)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self.answer(req, chat=False)

    @staticmethod
    def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
        kind = "invalid_request_error" if status == 400 else "server_error"
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                                 status=status, headers=headers)

    async def answer(self, req: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            body = await req.json()
            prompt = self.tok.encode_chat(body["messages"]) if chat else self.tok.encode_prompt(body["prompt"])
        except (ValueError, KeyError, TypeError, ChatTemplateError) as e:
            return self._error(400, f"bad request: {e}")
        cfg = self.cfg
        self.count += 1
        if cfg.error_every and self.count % cfg.error_every == 0:
            return self._error(500, "injected failure")
        if cfg.max_inflight is not None and self.inflight >= cfg.max_inflight:
            return self._error(429, "too many requests in flight",
                               {"Retry-After": str(cfg.retry_after_s),
                                "x-conductor-reject-reason": "overload: in-flight cap"})
        n = body.get("max_tokens")
        n = n if isinstance(n, int) and n >= 1 else 16
        if not body.get("ignore_eos") and cfg.eos_after:
            n = min(n, cfg.eos_after)
        stream = body.get("stream", False) and not cfg.never_stream
        self.inflight += 1
        pair = {"x-conductor-prefill": cfg.prefill_name, "x-conductor-decode": cfg.decode_name}
        try:
            if not stream:
                first = await self._prefill(arrived)
                await asyncio.sleep(max(0.0, first + (n - 1) * cfg.itl_s - loop.time()))
                return web.json_response(self._whole(chat, n, len(prompt)), headers=pair)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                               **pair})
            await resp.prepare(req)
            rid = f"fixed-{self.count}"
            if chat:  # a role-only chunk before any token, as OpenAI sends
                await self._send(resp, self._chunk(rid, chat, None, None, role=True))
            first = await self._prefill(arrived)
            for k in range(n):
                delay = first + k * cfg.itl_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._send(resp, self._chunk(rid, chat, "a", None))
            await self._send(resp, self._chunk(rid, chat, "", "length"))
            if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
                await self._send(resp, {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                        "model": cfg.model, "choices": [],
                                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                  "total_tokens": len(prompt) + n}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1

    async def _prefill(self, arrived: float) -> float:
        """Wait out the prefill; return when the first token is due."""
        loop = asyncio.get_running_loop()
        if self.prefill is None:
            return arrived + self.cfg.ttft_s
        async with self.prefill:
            await asyncio.sleep(self.cfg.ttft_s)
            return loop.time()

    def _chunk(self, rid: str, chat: bool, text: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "model": self.cfg.model, "choices": [choice]}
        return {"id": rid, "object": "text_completion", "model": self.cfg.model,
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}

    def _whole(self, chat: bool, n: int, n_prompt: int) -> dict:
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        if chat:
            return {"object": "chat.completion", "model": self.cfg.model, "usage": usage,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a" * n},
                                 "finish_reason": "length"}]}
        return {"object": "text_completion", "model": self.cfg.model, "usage": usage,
                "choices": [{"index": 0, "text": "a" * n, "finish_reason": "length"}]}

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def serve(cfg: TargetConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Start the target on ``host:port`` (0 = any free port); return the runner and its URL."""
    runner = web.AppRunner(FixedTarget(cfg).app(), access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return runner, f"http://{bound[0]}:{bound[1]}"


def _args(argv: list[str]):
    from predictors.cli_args import Parser, port, positive_float, positive_int

    p = Parser(prog="python -m loadgen.fixed_target", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0, help="0 = any free port (printed on start)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--model", default="fixed-model")
    p.add_argument("--prefill-slots", type=positive_int, help="concurrent prefills (TTFT then queues with load)")
    p.add_argument("--max-inflight", type=positive_int, help="answer 429 beyond this many requests in flight")
    p.add_argument("--eos-after", type=positive_int, help="without ignore_eos, stop after this many tokens")
    p.add_argument("--error-every", type=positive_int, help="answer HTTP 500 to every n-th request")
    p.add_argument("--no-usage", action="store_true", help="never send a usage chunk")
    p.add_argument("--retry-after", type=positive_float, default=1)
    p.add_argument("--api-key", help="require 'authorization: Bearer KEY'")
    p.add_argument("--never-stream", action="store_true", help="answer whole JSON even when asked to stream")
    a = p.parse_args(argv)
    if a.ttft_ms < 0 or a.itl_ms < 0:
        p.error("--ttft-ms and --itl-ms must be >= 0")
    cfg = TargetConfig(a.ttft_ms / 1000, a.itl_ms / 1000, a.model, a.prefill_slots, a.max_inflight, a.eos_after,
                       a.error_every, not a.no_usage, retry_after_s=int(a.retry_after), api_key=a.api_key,
                       never_stream=a.never_stream)
    return a, cfg


def main(argv: list[str] | None = None) -> int:
    a, cfg = _args(list(sys.argv[1:] if argv is None else argv))

    async def run() -> None:
        runner, url = await serve(cfg, a.host, a.port)
        print(f"fixed target listening on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    return 0


@contextlib.contextmanager
def spawn(*args: str, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Run the target in its own process on a free loopback port; yield its URL; stop it.

    A separate process keeps the target's event loop (and the GIL) apart from the client's, so
    the client's measurements are its own.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty target can never block
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.fixed_target", "--port", "0", *args],
                            cwd=root, stdout=subprocess.PIPE, stderr=errors, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + start_timeout_s
        line = ""
        while not line and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
        sel.close()
        if not line.startswith("fixed target listening on "):
            errors.seek(0)
            raise RuntimeError(f"fixed target did not start: {line!r} {errors.read()[-2000:]}")
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        errors.close()


if __name__ == "__main__":
    sys.exit(main())
