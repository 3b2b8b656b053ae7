"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

_FIELD = re.compile(r"^([a-z_][a-z0-9_.]*): ")  # kvabi's ValueErrors start with the field name


class APIError(Exception):
    """An error the client gets as an OpenAI error object; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A kvabi ValueError ("field: rule, got x") -> 400 naming the field (renamed for the API)."""
    message = str(exc)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    if param and rename and param in rename:
        param = rename[param]
        message = f"{param}: {message[match.end() :]}"
    return bad_request(message, param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error -> 400 naming its field; malformed JSON says so."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    msg = first["msg"].removeprefix("Value error, ")
    loc = first["loc"]
    if not loc:
        return from_value_error(ValueError(msg))
    param = f"{loc[0]}.{loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else str(loc[0])
    return bad_request(f"{_path(loc)}: {msg}", param)


def _path(loc: tuple[int | str, ...]) -> str:
    """messages.0.content: field names and list indexes, without pydantic's union branch tags."""
    tags = {"str", "int", "float", "bool", "list"}
    return ".".join(
        str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in tags)
    )
