"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""

from fastapi.responses import JSONResponse

from chitu_core.server.schemas import ErrorBody, ErrorResponse


class APIError(Exception):
    """An error to answer with; ``status`` 4xx for the caller's mistakes, 503 when overloaded."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
