"""Typed service errors; app.main maps each to its HTTP status."""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 400

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class BadRequest(ServiceError):
    status_code = 400


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class PayloadTooLarge(ServiceError):
    status_code = 413


class Invalid(ServiceError):
    """A well-formed request whose content is wrong (a bad config field, a bad upload row)."""

    status_code = 422


class Unavailable(ServiceError):
    """A service the request needs is down (the job queue's broker): try again later."""

    status_code = 503


class Unauthorized(ServiceError):
    status_code = 401


class Forbidden(ServiceError):
    status_code = 403
