"""AdapterError: an adapter problem a user caused, with the HTTP status the gateway answers it with."""
from __future__ import annotations


class AdapterError(ValueError):
    """A user-facing adapter problem; `status_code` is the HTTP status the gateway should answer with."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code
