"""HTTP errors: an ApiError is an answer (status, message naming the field, OpenAI's error body).

A RequestError (a bad request, neutral: it names the field) becomes a 400 through `from_request`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from distlm.inference.prompts import RequestError
from distlm.inference.server.responses import ErrorBody, ErrorDetail

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An HTTP error answer: status, message naming the field, OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self, *, close: bool = False) -> JSONResponse:
        headers = dict(self.headers)
        if close:  # the body was not read to its end: the connection cannot be reused
            headers["Connection"] = "close"
        return JSONResponse(
            error_doc(self.status, self.message, self.param, self.code).model_dump(),
            status_code=self.status,
            headers=headers,
        )


def error_doc(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> ErrorBody:
    """OpenAI's error body for `status`."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code))


def from_request(e: RequestError) -> ApiError:
    """A bad request's answer: its status (400) and message, `param` the field it names."""
    return ApiError(e.status, str(e), param=e.param)


def short(value) -> str:
    """A value as an error message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
