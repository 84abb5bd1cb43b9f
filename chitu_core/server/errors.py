"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status.

4xx are the caller's mistakes ("invalid_request_error"); 5xx are ours ("server_error"): 503 when
overloaded or when the engine has failed, 500 for the requests a failing engine was running."""

from fastapi.responses import JSONResponse

from chitu_core.server.schemas import ErrorBody, ErrorResponse


class APIError(Exception):
    """An error to answer with, as a JSON response or, once a stream has begun, as its last event."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_failed(status: int, message: str) -> APIError:
    """The engine is dead: 500 for the requests it was running, 503 for those that come after."""
    return APIError(status, message, "server_error", None, "engine_failed")
