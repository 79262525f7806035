"""Errors answered as OpenAI's JSON, and request bodies parsed into the request models with
every failure a 400 that names the field the client sent."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def model_not_found(model: str, served: Iterable[str]) -> APIError:
    """The 404 for a model name this server does not serve, naming those it does."""
    return APIError(404, f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                    param="model", code="model_not_found")


def queue_full(exc: Exception) -> APIError:
    """The 429 for a request the engine has no room for now (async_engine.QueueFullError)."""
    return APIError(429, str(exc), code="queue_full", type_="rate_limit_error")


def unreadable_body(exc: Exception) -> str:
    """What to tell a client whose body aiohttp could not decode (a corrupt gzip body, broken
    chunks): the parser's own words are on the exception's cause."""
    return f"the request body could not be read: {getattr(exc.__cause__, 'message', None) or exc}"


def strict_json(text: str | bytes) -> Any:
    """json.loads, with a ValueError for a number no double holds: NaN, Infinity, 1e400."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def parse_request(model: type[BaseModel], raw: bytes) -> Any:
    """Parse a JSON body into `model`, turning every failure into a 400 naming the field."""
    try:
        data = strict_json(raw)
    except ValueError as e:  # UnicodeDecodeError is one
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    try:
        # A lone UTF-16 surrogate ("\ud800") is valid JSON but no Unicode text: the tokenizer
        # failed on it with a 500 (found while fuzzing the API).
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise APIError(400, f"request body has a string that is not valid Unicode: {e.reason} at "
                            f"{e.object[max(0, e.start - 20):e.end]!r}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # The deepest error: of a union's members (a prompt's forms), the one that came closest.
        err = max(e.errors(), key=lambda error: len(error["loc"]))
        param = ".".join(str(p) for p in _json_path(data, err["loc"])) or None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported parameter: {param}", param=param,
                           code="unsupported_parameter") from None
        raise APIError(400, f"invalid value for {param}: {err['msg']}", param=param) from None


# How pydantic names a union's members in an error's loc: str, list[int], function-after[...].
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|literal|function-\w+)\[.*\])$")


def _json_path(data: Any, loc: tuple[str | int, ...]) -> list[str | int]:
    """The error's place in the request's JSON: pydantic's loc, less the names it gives union
    members ("prompt.str", "stop.list[str]"), which are no field a client sent."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and (part in node or not _UNION_MEMBER.match(str(part))):  # a field, sent or missing
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            path.append(part)
            node = node[part]
    return path


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(number: str) -> float:
    """A JSON number as a float, refusing one past a double's range (1e400), which float() reads
    as infinity: pydantic refuses that only in float fields, and in a free-form one (a JSON
    schema) llguidance read it as null and /v1/responses echoed it as Infinity, which is no JSON."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"the number {number} is out of a double's range")
    return value
