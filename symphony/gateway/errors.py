"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``,
or, on the Anthropic routes (``/v1/messages``), as Anthropic does:
``{"type": "error", "error": {"type", "message"}}``.

Every failure a route knows of is an `ApiError` with its HTTP status; the
app turns anything else into a 500 with a request id (and a log line), which
a test treats as a bug.
"""
from __future__ import annotations

from typing import Optional

import orjson

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


_ANTHROPIC = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
              503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """A request the gateway answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, code: Optional[str] = None, param: Optional[str] = None,
                 retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self, shape: str = "openai") -> dict:
        """The error object: OpenAI's, or with ``shape`` "anthropic" Anthropic's."""
        if shape == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC.get(self.status, "api_error" if self.status >= 500
                                                                     else "invalid_request_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self, shape: str = "openai") -> bytes:
        return orjson.dumps(self.body(shape))

    def headers(self) -> dict:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}
