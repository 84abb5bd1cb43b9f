"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status.

4xx are the caller's mistakes ("invalid_request_error"); 5xx are ours ("server_error"): 503 when
overloaded or when the engine has failed, 500 for the requests a failing engine was running."""

import re

from fastapi.responses import JSONResponse

from chitu_core.server.schemas import ErrorBody, ErrorResponse


class APIError(Exception):
    """An error to answer with, as a JSON response or, once a stream has begun, as its last event."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else self.headers
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_failed(status: int, message: str) -> APIError:
    """The engine is dead: 500 for the requests it was running, 503 for those that come after."""
    return APIError(status, message, "server_error", None, "engine_failed")


def invalid_request(errors: list[dict]) -> APIError:
    """A body that failed validation (pydantic's errors, locations starting with "body") as one
    400 naming the field of the first error. A body that is not JSON names no field. For a field
    whose type is a union (prompt, stop, a message's content), pydantic reports one error per
    member of the union; the message is then that of the member the value came closest to (a
    value of the right type that broke a bound), else the list of the types it may have."""
    if not errors:
        return bad_request("invalid request: the body is malformed; send one JSON object")
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "decode error")
        return bad_request(f"invalid request: the body is not valid JSON ({reason} at character {first['loc'][-1]}); "
                           "send one JSON object with 'Content-Type: application/json'")
    loc, message = tuple(first["loc"]), first["msg"]
    cut = next((i for i, part in enumerate(loc) if _is_union_member(part)), None)
    if cut is not None:  # the errors of every member of the union at loc[:cut]
        members = [e for e in errors if tuple(e["loc"][:cut]) == loc[:cut] and len(e["loc"]) > cut
                   and _is_union_member(e["loc"][cut])]
        broken = [e for e in members if not e["type"].endswith("_type")]
        if broken:
            loc, message = tuple(broken[0]["loc"]), broken[0]["msg"]
        else:
            kinds = dict.fromkeys(e["loc"][cut].replace("constrained-", "") for e in members)
            loc, message = loc[:cut], f"Input should be one of: {', '.join(kinds)}"
    where = ".".join(str(p) for p in loc if p != "body" and not _is_union_member(p)) or None
    return bad_request(f"invalid request: {where or 'body'}: {message}", where)


_UNION_MEMBER = re.compile(r"[^A-Za-z0-9_]|^(str|int|float|bool|none)$")


def _is_union_member(part) -> bool:
    """pydantic names a union's members in error locations by their types ('str', 'list[int]',
    'constrained-str'): no field of ours is so named."""
    return isinstance(part, str) and bool(_UNION_MEMBER.search(part))
