"""The HTTP transport: uvicorn's httptools protocol with a bound on the time a request takes to arrive.

uvicorn bounds only the idle time between requests of a keep-alive connection
(``timeout_keep_alive``). A client that opens a connection and sends nothing, or sends part of
the headers or of the body and then stalls, would hold its connection — and, once the headers
are in, a request waiting for its body — for as long as it likes. Here every request, the
first on a connection or a later one on a keep-alive connection, must arrive in full (request
line, headers and body) within ``read_timeout_s`` of its first byte (the first request: of the
connection's opening). When that runs out:

- nothing of a request arrived (a connection that sends nothing): the connection is closed;
- part of it arrived and no response has started: a ``408`` JSON ``{"error": ...}`` with
  ``Connection: close``, then the connection is closed (a route waiting for the body sees the
  client gone);
- a response is being written, or the server stopped reading (its own back-pressure, a
  pipelined request waiting for the one before it): nothing is cut; the bound starts again.

The clock runs only while the server waits for the client's bytes: once a request has arrived,
its inference and its response (streamed or not) take as long as they take. No timer is set
for a request that arrives in one read, which is the common case: the per-request path is
uvicorn's own.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from torchkeel.errors import ConfigError

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError as exc:  # uvicorn[standard] brings httptools
    raise ConfigError(f"keel serve needs httptools ({exc}); pip install 'uvicorn[standard]'") from None

DEFAULT_READ_TIMEOUT_S = 30.0


def bounded_read_protocol(read_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: requests must arrive within ``read_timeout_s``.

    Raises:
        ConfigError: ``read_timeout_s`` is not a positive number.
    """
    if not 0 < read_timeout_s < math.inf:
        raise ConfigError(f"--read-timeout-s must be a positive number of seconds, got {read_timeout_s}")
    return type("BoundedReadProtocol", (BoundedReadProtocol,), {"read_timeout_s": float(read_timeout_s)})


def timeout_response(read_timeout_s: float) -> bytes:
    """The 408 sent to a client whose request did not arrive in time, in the server's error shape."""
    body = json.dumps(
        {
            "error": f"the request did not arrive in full within {read_timeout_s:g} s (--read-timeout-s); "
            "send the whole request at once, or raise the bound"
        }
    ).encode()
    head = (
        f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedReadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request must arrive within ``read_timeout_s`` (see the module)."""

    read_timeout_s = DEFAULT_READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_deadline: asyncio.TimerHandle | None = None
        self.is_reading = False  # a request has begun and not yet arrived in full
        self.has_headers = False  # ... and its headers are in (its response cycle is the current one)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request is owed from the connection's opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.is_reading:
            self._disarm()
        elif self.read_deadline is None:  # a request spans reads: from now on it runs against the clock
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.is_reading, self.has_headers = True, False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.has_headers = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.is_reading = False

    def _arm(self) -> None:
        self.read_deadline = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _timed_out(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or a WebSocket now
            return
        cycle = self.cycle
        owed = cycle is not None and not cycle.response_complete  # a response this connection still writes
        if self.flow.read_paused or (owed and (cycle.response_started or not self.has_headers)):
            self._arm()  # the server is the one waiting (back-pressure, an earlier request): not the client
            return
        if self.is_reading and not (self.has_headers and cycle is not None and cycle.response_complete):
            self.transport.write(timeout_response(self.read_timeout_s))
        self.transport.close()
