"""The typed errors of one call to one SGLang server, and what the client does with each.

Every HTTP call of the client ends in a reply or in one of these (raised by :meth:`Fleet.request
<sapo_megatron.rollout.sglang.fleet.Fleet.request>`):

==========================  =======================================  ========================================
error                       cause                                    kind
==========================  =======================================  ========================================
:class:`Unreachable`        connection refused / reset, timeout      transient: another attempt may succeed
:class:`Overloaded`         HTTP 429 or 5xx                          transient
:class:`Refused`            HTTP 4xx, or ``"success": false``        lasting: the request or setup is wrong
:class:`MalformedReply`     a body that is no JSON (object)          lasting: a misconfiguration
``RolloutError``            a reply with missing or wrong fields     lasting (``rollout.protocol``)
==========================  =======================================  ========================================

What a transient error leads to depends on the call (:class:`OnTransient`), decided in one place
(:func:`on_error`): generation and scoring fail over to another server, a weight update leaves the server out
(stale), a cache flush cools it down, and a call that needs every worker raises :class:`Unavailable`. A lasting
error is always raised as it is, never retried.
"""

from __future__ import annotations

import enum

import httpx

from sapo_megatron.rollout.base import RolloutError


class TransientError(RolloutError):
    """A failure that another attempt (possibly on another server) may not have. ``detail``: the message without
    the ``[server=...]`` context, for the error that reports it."""

    def __init__(self, detail: str, *, server: str | None = None, request: str | None = None) -> None:
        self.detail = detail
        super().__init__(detail, server=server, request=request, field="transport")


class Unreachable(TransientError):
    """No reply: the connection was refused or reset, or the request timed out."""


class Overloaded(TransientError):
    """HTTP 429 or 5xx: the server is busy or failed on this request."""

    def __init__(
        self, detail: str, *, status: int, server: str | None = None, request: str | None = None
    ) -> None:
        self.status = status
        super().__init__(detail, server=server, request=request)


class Refused(RolloutError):
    """The server answered and refused: HTTP 4xx (``field="<status>"``, ``status`` set) or ``success: false``."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        server: str | None = None,
        request: str | None = None,
        field: str = "<status>",
    ) -> None:
        self.status = status
        super().__init__(message, server=server, request=request, field=field)


class MalformedReply(RolloutError):
    """The body of a reply is not what the endpoint answers (not JSON, not an object)."""


class Unavailable(RolloutError):
    """No server could serve a call: every attempt failed transiently, or a worker that the call needs was
    unreachable."""


class Cancelled(Exception):
    """Another sample of the same call failed for good; stop early."""


class OnTransient(enum.Enum):
    """What a transient error leads to in a call (a lasting error is always raised)."""

    FAIL_OVER = "fail over"  # cool the server down, try the next one (generation, scoring)
    SKIP = "skip"  # leave the server out of this weight update: it becomes stale (none left: Unavailable)
    COOL_DOWN = "cool down"  # skip it for now, log it (cache flush)
    RAISE = "raise"  # the call needs every worker: raise Unavailable


def on_error(exc: Exception, policy: OnTransient) -> OnTransient:
    """What to do with ``exc`` raised by a call under ``policy``: the policy itself for a transient error,
    :attr:`OnTransient.RAISE` (raise ``exc`` as it is) for any other."""
    return policy if isinstance(exc, TransientError) else OnTransient.RAISE


def unavailable(what: str, exc: TransientError, server: str) -> Unavailable:
    """The error of a call that needed a worker that was unreachable."""
    return Unavailable(f"{what}: unreachable: {exc.detail}", server=server, field="transport")


def check_status(response: httpx.Response, *, server: str, path: str, request: str) -> None:
    """Raise the typed error of an HTTP status that is not a success."""
    status = response.status_code
    if status == 429 or status >= 500:
        raise Overloaded(
            f"HTTP {status} from {path}: {response.text[:300]}", status=status, server=server, request=request
        )
    if status >= 400:
        raise Refused(
            f"HTTP {status} from {path}: {error_message(response)}",
            status=status,
            server=server,
            request=request,
        )


def json_reply(response: httpx.Response, *, server: str, path: str, request: str) -> object:
    """The JSON body of a reply, or :class:`MalformedReply`."""
    try:
        return response.json()
    except ValueError as exc:
        raise MalformedReply(
            f"reply of {path} is not valid JSON ({exc}): {response.text[:200]!r}",
            server=server,
            request=request,
            field="<body>",
        ) from exc


def error_message(response: httpx.Response) -> str:
    """The message of an error reply (SGLang's ``{"error": {"message"}}`` or ``{"message"}``), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]
