"""vLLM's error envelope: every error a client gets is an APIError, rendered as
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

from typing import Any

ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 413: "BadRequestError",
               415: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered to the client with vLLM's envelope."""

    def __init__(self, message: str, status: int = 400, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or ERROR_TYPES.get(status, "BadRequestError")
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
