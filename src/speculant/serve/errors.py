"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response


class APIError(Exception):
    """A request the server refuses or could not serve; ``message`` says what to change."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII JSON: a message or param that quotes a client's broken text still encodes
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages do not echo huge values."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "a very large integer"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(v: Any) -> bool:
    """An integer, and not a boolean (JSON's true is no number)."""
    return isinstance(v, int) and not isinstance(v, bool)


def kind_of(v: Any) -> str:
    """What a JSON value is, for a message: "an object", "a list", "a string", ..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)
