"""Which storage errors are worth retrying, the one backoff, and the retry loop (with full
jitter)."""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import threading
import time
from typing import Awaitable, Callable, TypeVar

__all__ = ["RetryPolicy", "backoff_seconds", "is_transient_error", "is_throttling_error",
           "error_code", "is_credentials_error", "is_precondition_failed"]

log = logging.getLogger("ckpt.storage")
T = TypeVar("T")


_TRANSIENT_CODES = {
    "SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
    "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "ConditionalRequestConflict", "500", "502", "503", "504",
}
# Exception types (by class name anywhere in the MRO, so botocore/aiohttp need not be
# importable here) that mean "the request did not get a definite answer".
_TRANSIENT_TYPES = {
    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
    "ServerTimeoutError", "EndpointConnectionError", "ConnectionClosedError", "HTTPClientError",
    "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError", "FSTimeoutError",
    "IncompleteRead", "IncompleteReadError", "ResponseParserError", "ProtocolError",
}
# The service is up and asks for fewer requests (S3 answers 503 SlowDown; others 429).
_THROTTLING_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "ServiceUnavailable", "503", "429",
}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "403",
}
_CREDENTIAL_TYPES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def _causes(exc: BaseException | None):
    """``exc`` and the exceptions it was raised from (explicit cause, else implicit context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _type_names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def error_code(exc: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status found on ``exc`` or its causes (``("", 0)`` if none)."""
    for e in _causes(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", "") or "")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code or status:
                return code, int(status)
    return "", 0


def is_transient_error(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, dropped connections, S3 throttling/5xx."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    code, status = error_code(exc)
    if code or status:
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    for e in _causes(exc):
        if isinstance(e, (TimeoutError, ConnectionError)) or _type_names(e) & _TRANSIENT_TYPES:
            return True
        if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.ETIMEDOUT,
                                                  errno.ECONNRESET, errno.ECONNREFUSED,
                                                  errno.EPIPE):
            return True
    return False


def is_throttling_error(exc: BaseException) -> bool:
    """True when the service answered but asked for fewer requests (S3's ``503 SlowDown``,
    a 429): it is up, and patience, not a fix of the endpoint, gets the request through."""
    code, status = error_code(exc)
    return code in _THROTTLING_CODES or status in (429, 503)


def is_credentials_error(exc: BaseException) -> bool:
    """True for refused credentials: a bad key or signature, an expired token, 403."""
    code, status = error_code(exc)
    if code in _CREDENTIAL_CODES or status == 403:
        return True
    return any(_type_names(e) & _CREDENTIAL_TYPES for e in _causes(exc))


def is_precondition_failed(exc: BaseException) -> bool:
    """True when a conditional write was refused (412 ``PreconditionFailed``)."""
    code, status = error_code(exc)
    return code == "PreconditionFailed" or status == 412


def backoff_seconds(retry: int, base_seconds: float, max_seconds: float) -> float:
    """The exponential backoff before retry ``retry`` (1-based): ``base_seconds`` doubled
    for each retry before it, at most ``max_seconds``.

    :class:`RetryPolicy` pauses a uniform draw below it (full jitter: many ranks hitting one
    throttled endpoint spread out); the manager's save re-attempts
    (:class:`ckpt.job.persist.Persister`) pause exactly this long, every rank alike, since
    each attempt is a collective that all ranks enter together anyway.
    """
    return min(max_seconds, base_seconds * 2 ** (retry - 1))


class RetryPolicy:
    """Exponential backoff with full jitter for transient storage errors.

    ``attempts`` counts the first try: 5 means up to 4 retries. The delay before retry ``k``
    (1-based) is uniform in ``[0, backoff_seconds(k, base_seconds, max_seconds)]``, i.e.
    below ``min(max_seconds, base_seconds * 2**(k-1))``. Two optional bounds in time, counted
    from a request's first try: ``deadline_seconds``, after which no retry starts (a request
    that hangs until its timeout is tried fewer times), and ``throttled_seconds``: while the
    service throttles (:func:`is_throttling_error`), retries go on past ``attempts`` until
    then (an operator's command waits out a throttled bucket as a job's saves do).
    ``num_retries`` is the total number of retries performed through this policy, across
    threads, for events and metrics. A request given up on carries ``retry_attempts`` and
    ``retry_seconds`` on its exception, for the message that reports it.

    The jitter comes from the policy's own generator (seeded from the OS), never from the
    module-level ``random``: a job seeds that one and checkpoints it (``RNGState``), so a
    storage retry must not move it.
    """

    def __init__(self, attempts: int = 5, base_seconds: float = 0.2, max_seconds: float = 10.0,
                 *, deadline_seconds: float | None = None,
                 throttled_seconds: float | None = None):
        if attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {attempts}")
        if base_seconds < 0 or max_seconds < 0:
            raise ValueError("RetryPolicy.base_seconds and max_seconds must be >= 0")
        for name, value in (("deadline_seconds", deadline_seconds),
                            ("throttled_seconds", throttled_seconds)):
            if value is not None and not value >= 0:
                raise ValueError(f"RetryPolicy.{name} must be >= 0 or None, got {value}")
        self.attempts = attempts
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self.deadline_seconds = deadline_seconds
        self.throttled_seconds = throttled_seconds
        self.num_retries = 0
        self._lock = threading.Lock()
        self._jitter = random.Random()

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"], state["_jitter"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        # A fresh seed per copy: ranks given one pickled policy must not back off in step.
        self._jitter = random.Random()

    def _should_retry(self, what: str, exc: BaseException, attempt: int,
                      started: float | None = None) -> float | None:
        """The delay before the next attempt, or None to give up (and count the retry).
        ``started``: ``time.monotonic()`` at the request's first try (None: now)."""
        if not is_transient_error(exc):
            return None
        elapsed = 0.0 if started is None else time.monotonic() - started
        patient = self.throttled_seconds is not None and is_throttling_error(exc)
        limit = self.throttled_seconds if patient else self.deadline_seconds
        if (attempt >= self.attempts and not patient) or \
                (limit is not None and elapsed >= limit):
            exc.retry_attempts, exc.retry_seconds = attempt, elapsed
            return None
        cap = backoff_seconds(min(attempt, 64), self.base_seconds, self.max_seconds)
        with self._lock:
            delay = self._jitter.uniform(0, cap)
            self.num_retries += 1
        if limit is not None:
            delay = min(delay, max(0.0, limit - elapsed))
        if patient:
            log.warning("%s throttled (%s: %s); retry %d in %.2fs (for up to %.0fs)", what,
                        type(exc).__name__, exc, attempt, delay, limit)
        else:
            log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__,
                        exc, attempt, self.attempts - 1, delay)
        return delay

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried on transient errors; the last error is raised as is."""
        attempt, started = 0, time.monotonic()
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - filtered by _should_retry
                delay = self._should_retry(what, exc, attempt, started)
                if delay is None:
                    raise
            time.sleep(delay)

    async def acall(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Like :meth:`call` for coroutines: ``await fn()`` with retries, sleeping async."""
        attempt, started = 0, time.monotonic()
        while True:
            attempt += 1
            try:
                return await fn()
            except Exception as exc:  # noqa: BLE001 - filtered by _should_retry
                delay = self._should_retry(what, exc, attempt, started)
                if delay is None:
                    raise
            await asyncio.sleep(delay)
