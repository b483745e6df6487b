"""HTTP/1.1 transport of :mod:`cpu_server`: a threaded stdlib server sized for the rollout client, and API keys.

Why the stdlib and not uvicorn (which SGLang runs, with ``timeout_keep_alive=5`` and uvicorn's listen backlog of
2048): the two properties the client depends on are a listen backlog deeper than its concurrency and persistent
connections, and ``http.server`` has both once configured (:data:`LISTEN_BACKLOG`, HTTP/1.1 keep-alive); the work
behind each request is a blocking engine call that a thread per connection serves naturally, and a stopped server
must drop requests in flight without a reply (the fault tests emulate a crash that way), which a graceful ASGI
shutdown would not do. No dependency is added.

The old configuration (``ThreadingHTTPServer``'s default backlog of 5, HTTP/1.0: one connection per request)
reset most connections of a burst: in two runs 224 and 234 of 256 simultaneous ``/generate`` requests got
"Connection reset by peer", and the client at concurrency 128 needed 125 retries for 512 samples.
Idle keep-alive connections are closed after :data:`KEEP_ALIVE_TIMEOUT_S`, longer than httpx's 5 s pool expiry,
so that the client always closes an idle connection first and never sends on one the server is closing.

API key (SGLang ``python/sglang/srt/utils/auth.py``: ``decide_request_auth`` and ``add_api_key_middleware``; older
releases: ``add_api_key_middleware`` in ``python/sglang/srt/utils/common.py``): with a key, every request needs
``Authorization: Bearer <key>`` (scheme case-insensitive; SGLang also takes an ``x-api-key: <key>`` header) except
``OPTIONS`` and paths starting with ``/health``, ``/ready`` or ``/metrics``; others get HTTP 401
``{"error": "Unauthorized"}``. Weight-update endpoints are ``ADMIN_OPTIONAL`` in SGLang, which with only
``--api-key`` set (no ``--admin-api-key``) means the same: the API key.

Limits (:class:`Limits`; hostile or broken clients must not cost memory, threads or other clients' requests):
the key is checked from the headers before any body byte is read (401, connection closed); a ``Content-Length``
above ``max_body_bytes`` is answered 413 at once without reading it (a chunked body as soon as it grows past
it); at most ``max_connections`` connections are served at a time, each on its own thread, and a connection
beyond that gets 503 and is closed before a thread is made; :meth:`Request.client_gone` tells the application
that the client hung up, so that queued work for it is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import select
import socket
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from sapo_megatron.rollout.cpu.flags import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # above any client concurrency we use (128); Linux caps it at net.core.somaxconn (4096)
KEEP_ALIVE_TIMEOUT_S = 75.0
_AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")

Response = tuple[int, bytes, str]  # status, body, content type


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS


@dataclasses.dataclass(frozen=True)
class Request:
    """What a handler may know about the request besides its body: the peer and whether it is still there."""

    peer_host: str
    connection: socket.socket | None = None

    @property
    def from_loopback(self) -> bool:
        return self.peer_host in ("127.0.0.1", "::1", "localhost") or self.peer_host.startswith("127.")

    def client_gone(self) -> bool:
        """True once the client closed its connection (readable, and a peek returns no byte)."""
        if self.connection is None:
            return False
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (OSError, ValueError):  # reset or already closed
            return True


class App(Protocol):
    stopped: bool

    def authorize(self, method: str, path: str, headers: Mapping[str, str]) -> bool: ...

    def handle(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes, request: Request
    ) -> Response: ...


def check_framing(headers: Any) -> None:
    """Refuse a request whose length is ambiguous (RFC 9112 §6.3): two ``Content-Length`` headers, or one with
    ``Transfer-Encoding``. A proxy in front may read such a request differently (request smuggling)."""
    lengths = headers.get_all("Content-Length") or []
    if len(lengths) > 1:
        raise ValueError(f"{len(lengths)} Content-Length headers; a request has at most one")
    if lengths and headers.get_all("Transfer-Encoding"):
        raise ValueError("Content-Length together with Transfer-Encoding; a request has one or the other")


def json_response(status: int, payload: Any) -> Response:
    return int(status), json.dumps(payload).encode(), "application/json"


def text_response(status: int, text: str) -> Response:
    return int(status), text.encode(), "text/plain; charset=utf-8"


def authorized(method: str, path: str, headers: Mapping[str, str], api_key: str | None) -> bool:
    """SGLang's decision for a server with ``--api-key`` (and no admin key)."""
    if api_key is None or method == "OPTIONS" or path.startswith(_AUTH_EXEMPT_PREFIXES):
        return True
    expected = api_key.encode()
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), expected):
        return True
    header_key = headers.get("x-api-key")
    return header_key is not None and secrets.compare_digest(header_key.encode(), expected)


UNAUTHORIZED: Response = json_response(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})


class BodyTooLarge(ValueError):
    """A body longer than ``Limits.max_body_bytes``; answered 413 and the connection closed."""


class HTTPServer(ThreadingHTTPServer):
    """Binds and listens on construction; one thread per connection; knows its open connections."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], app: App, limits: Limits | None = None) -> None:
        self.app = app
        self.limits = limits or Limits()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection while a slot is free; beyond ``max_connections``: 503 and close, no thread."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def track(self, connection: socket.socket, alive: bool) -> None:
        with self._connections_lock:
            (self._connections.add if alive else self._connections.discard)(connection)

    def drop_connections(self) -> None:
        """Cut every open connection, as a crashed server would (no reply to requests in flight)."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by the peer
                connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = KEEP_ALIVE_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, alive=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, alive=False)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        app = self.server.app
        if not app.authorize(method, path, self._header_map()):  # before reading a byte of the body
            self.close_connection = True
            self._send(*UNAUTHORIZED)
            return
        try:
            body = self._read_body()
        except BodyTooLarge as exc:
            self.close_connection = True
            self._send(*json_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": {"message": str(exc)}}))
            return
        except ValueError as exc:  # the stream position is unknown now: answer and close
            self.close_connection = True
            self._send(*json_response(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}}))
            return
        request = Request(peer_host=str(self.client_address[0]), connection=self.connection)
        try:
            response = app.handle(method, path, self._header_map(), body, request)
        except Exception as exc:
            if app.stopped:
                self.close_connection = True  # a stopped server answers nothing, like a crashed one
                return
            logger.exception("%s %s failed", method, path)
            message = f"{type(exc).__name__}: {exc}"
            response = json_response(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": message}})
        self._send(*response)

    def _read_body(self) -> bytes:
        check_framing(self.headers)
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ValueError(f"bad Content-Length {self.headers.get('Content-Length')!r}") from None
        if length < 0:
            raise ValueError(f"bad Content-Length {length}")
        self._check_size(length)
        return self.rfile.read(length) if length else b""

    def _check_size(self, length: int) -> None:
        limit = self.server.limits.max_body_bytes
        if length > limit:
            raise BodyTooLarge(
                f"request body of {length} bytes exceeds the server's limit of {limit} bytes (--max-body-bytes)"
            )

    def _header_map(self) -> Mapping[str, str]:
        """The request's headers: an ``email.message.Message`` reads as a case-insensitive mapping (get, [],
        in, keys) without being a registered ``Mapping``."""
        return cast("Mapping[str, str]", self.headers)

    def _read_chunked(self) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(65537)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError(f"bad chunk size line {line[:40]!r}") from None
            if size < 0:
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            total += size
            self._check_size(total)
            chunks.append(self.rfile.read(size))
            self.rfile.readline()  # the CRLF after each chunk

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        if self.server.app.stopped:
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # the body was not read: the client must not send more on this connection
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: 59\r\n\r\n{"error": {"message": "too many connections, retry later"}}'
)
