"""vLLM's error envelope: every error a client gets is an APIError, rendered as
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

# vLLM's names, and the OpenAI client's for the statuses vLLM does not name
ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 403: "PermissionDeniedError", 404: "NotFoundError",
               409: "ConflictError", 413: "BadRequestError", 415: "BadRequestError", 422: "UnprocessableEntityError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_type(status: int) -> str:
    """The envelope's type for `status`: vLLM's name where it has one, else the status phrase in the same
    form (405: MethodNotAllowedError, 501: NotImplementedError)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "") + "Error"
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"


class APIError(Exception):
    """An error answered to the client with vLLM's envelope."""

    def __init__(self, message: str, status: int = 400, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or error_type(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", 404, param="model")


def check(ok: bool, message: str, param: str | None) -> None:
    """A 400 APIError with `message`, naming the request field `param`, unless `ok`."""
    if not ok:
        raise APIError(message, param=param)
