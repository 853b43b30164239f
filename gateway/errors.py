"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {404: "not_found_error",
          429: "rate_limit_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status: any other 4xx is the client's (``invalid_request_error``,
    e.g. 405, 413, 431), any other 5xx ours (``server_error``)."""
    return _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    err = {"message": message, "type": error_type(status), "param": param, "code": code}
    return json.dumps({"error": err}).encode()


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, code, param), status_code=status,
                    media_type="application/json", headers=headers)


def sse_error(status: int, message: str, code: str | None = None) -> bytes:
    """The event a stream ends with when the engine fails after the first byte."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"


class RequestError(Exception):
    """A client error found while validating a request (turned into a 4xx error response)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> Response:
        return error_response(self.status, self.message, self.code, self.param)
