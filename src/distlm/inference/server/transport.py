"""The API server's HTTP transport, as uvicorn serves it with httptools (llhttp, the C parser
`uvicorn[standard]` and vLLM run) and the guards added here: a request head must arrive within a
deadline and stay within a size (`GuardedHttpToolsProtocol`, against slowloris and header floods),
a connection closed after an early error while its body still arrives lingers so the client reads
the status instead of a reset (`_LingeringTransport`, as nginx does), a turn of the event loop's
writes to a connection go out as one (a response's head and body: one system call and one wake-up
of the client), and the open-file limit is raised for thousands of idle connections
(`raise_nofile`). The supervisor (inference/server/supervisor.py) runs uvicorn with them.

httptools, not h11: h11 parses in Python, and it and uvicorn's protocol around it were 16% of the
API server's CPU at 64 clients (docs/performance.md); llhttp does it in C. The guards that h11 gave
(its limit on an incomplete head) are kept here, counted on llhttp's callbacks."""

from __future__ import annotations

import asyncio
import resource
from typing import cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from distlm.core.log import get_logger

log = get_logger(__name__)


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: what uvicorn writes in one turn of the event
    loop goes to the socket as one write at the turn's end (uvicorn writes a response's head, its
    body and its end apart: with this, one system call, and a client that reads the head and then
    the body wakes once); and a close() while the client may still be sending its body (an early
    413, 408 or 400) becomes a lingering close, as nginx does.

    Closing a socket with unread data makes the kernel answer with a reset, which throws away
    the response the client has not read yet. So the write side is shut (the response is
    flushed, then FIN) and what the client still sends is read and discarded, until it closes,
    `linger_bytes` were discarded or `linger_s` passed; then the socket is closed."""

    def __init__(self, transport, protocol: GuardedHttpToolsProtocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.lingering = False
        self.discarded = 0
        self._timer = None
        self._pending: list[bytes] | None = None  # this turn's writes, not yet written

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def write(self, data) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [bytes(data)]
            self._protocol.loop.call_soon(self.flush)
        else:
            self._pending.append(bytes(data))

    def flush(self) -> None:
        """This turn's writes, as one."""
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending or ()))

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        t = self._transport
        if self.lingering or t.is_closing():
            return
        self.flush()  # what was written goes out before the close
        if not self._protocol.client_sending() or not t.can_write_eof():
            t.close()
            return
        self.lingering = True
        t.write_eof()
        t.resume_reading()
        self._timer = self._protocol.loop.call_later(self._protocol.linger_s, self.shut)

    def discard(self, data: bytes) -> None:
        self.discarded += len(data)
        if self.discarded > self._protocol.linger_bytes:
            self.shut()

    def shut(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()


class _HeadTooLarge(Exception):
    """Raised in a parser callback: llhttp stops, and uvicorn answers 400 (send_400_response)."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size limit and a lingering
    close.

    A request's head (from the connection's start, or from its first byte after a keep-alive)
    must be complete within `header_timeout_s`, else 408 and the connection is closed
    (slowloris), and at most `max_header_bytes` long (its request line and header lines), else
    400 naming serve.max_header_bytes: counted both on what llhttp has parsed and on the bytes
    that arrived while the head was still incomplete (what llhttp holds for a header not yet
    ended). A connection closed after an early error while its body is still arriving lingers
    (_LingeringTransport), so the client reads the status instead of a reset."""

    header_timeout_s = 10.0
    max_header_bytes = 16384
    linger_s = 5.0
    linger_bytes = 128 << 20

    def connection_made(self, transport) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        self._in_head = True  # a request's head has begun (or the connection is new), not ended
        self._head_parsed = 0  # bytes of the head llhttp has handed over (URL, header lines)
        self._head_arrived = 0  # bytes that arrived while the head stayed incomplete
        self._in_body = False  # a request's head has ended, its body not
        self._malformed = False  # llhttp refused the request (a 400 is on its way)
        # uvicorn sees the wrapper as its transport (it forwards what it does not override)
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    @property
    def _lingering(self) -> _LingeringTransport:
        return cast(_LingeringTransport, self.transport)

    def client_sending(self) -> bool:
        """Whether the client may still be sending: its request's body has not all arrived, or
        its request was malformed (so where it ends is unknown)."""
        return self._in_body or self._malformed

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering:  # after the answer: read and discard, bounded
            self._lingering.discard(data)
            return
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_header_timer()
            return
        if self._in_head:
            self._head_arrived += len(data)
            if self._head_arrived > self.max_header_bytes:
                self.send_400_response(self._too_large())
                return
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(
                    self.header_timeout_s, self._header_timeout
                )
        else:
            self._cancel_header_timer()

    def send_400_response(self, msg: str) -> None:
        self._malformed = True
        if self._head_parsed > self.max_header_bytes:
            msg = self._too_large()
        self.logger.info("answering 400: %s", msg)
        super().send_400_response(msg)

    def _too_large(self) -> str:
        return f"request head larger than {self.max_header_bytes} bytes (serve.max_header_bytes)"

    # llhttp's callbacks
    def on_message_begin(self) -> None:
        self._in_head, self._head_parsed, self._head_arrived = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > self.max_header_bytes:
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body = False, True
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        if self._lingering.lingering:
            self._lingering.shut()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_head and not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                    b"connection: close\r\n\r\n"
                )
            self.logger.info(
                "closing a connection whose request head did not arrive within "
                "%g s (serve.header_timeout_s)",
                self.header_timeout_s,
            )
            self.transport.close()


def raise_nofile() -> tuple[int, int]:
    """The open-file limit raised to its hard limit (each idle connection holds a descriptor);
    (soft limit before, soft limit now). A limit the kernel refuses is logged and kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
            return soft, soft
    return soft, max(soft, want)
