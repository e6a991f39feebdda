"""The API server's HTTP transport, as uvicorn serves it with h11 and the guards added here: a
request head must arrive within a deadline (`GuardedH11Protocol`, against slowloris), a
connection closed after an early error while its body still arrives lingers so the client reads
the status instead of a reset (`_LingeringTransport`, as nginx does), and the open-file limit is
raised for thousands of idle connections (`raise_nofile`). The supervisor
(inference/server/supervisor.py) runs uvicorn with them."""

from __future__ import annotations

import asyncio
import resource
from typing import cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from distlm.core.log import get_logger

log = get_logger(__name__)


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: a close() while the client may still be
    sending its body (an early 413, 408 or 400) becomes a lingering close, as nginx does.

    Closing a socket with unread data makes the kernel answer with a reset, which throws away
    the response the client has not read yet. So the write side is shut (the response is
    flushed, then FIN) and what the client still sends is read and discarded, until it closes,
    `linger_bytes` were discarded or `linger_s` passed; then the socket is closed."""

    def __init__(self, transport, protocol: GuardedH11Protocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.lingering = False
        self.discarded = 0
        self._timer = None

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        t = self._transport
        if self.lingering or t.is_closing():
            return
        if self._protocol.conn.their_state not in (h11.SEND_BODY, h11.ERROR) or not (
            t.can_write_eof()
        ):
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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a lingering close.

    A request's head (from the connection's start, or from its first byte after a keep-alive)
    must be complete within `header_timeout_s`, else 408 and the connection is closed
    (slowloris). A connection closed after an early error while its body is still arriving
    lingers (_LingeringTransport), so the client reads the status instead of a reset."""

    header_timeout_s = 10.0
    linger_s = 5.0
    linger_bytes = 128 << 20

    def connection_made(self, transport) -> None:
        # uvicorn sees the wrapper as its transport (it forwards what it does not override)
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    @property
    def _lingering(self) -> _LingeringTransport:
        return cast(_LingeringTransport, self.transport)

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering:  # after the answer: read and discard, bounded
            self._lingering.discard(data)
            return
        super().data_received(data)
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)
        elif not waiting:
            self._cancel_header_timer()

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
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
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
