"""The one error type of the HTTP edge: carries the status and the fields of OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``, ``code`` a string or null as in OpenAI's API)."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
