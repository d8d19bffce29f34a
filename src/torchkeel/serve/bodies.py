"""Request bodies, read with a bound on their size (``--max-body-mb``).

A body over the bound is a ``413`` the client can read: what is left of it is read and dropped
first, up to 4x the limit (at least 64 MiB) or 5 s, so that closing the connection does not
reset it before the client reads the answer; past that bound the connection is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.types import Receive, Scope

from torchkeel.serve.tensors import ProtocolError

DRAIN_FACTOR, DRAIN_MIN_BYTES, DRAIN_S = 4, 64 * 2**20, 5.0


class RequestBodies:
    """Reads request bodies of at most ``max_body_mb`` MiB."""

    def __init__(self, max_body_mb: float) -> None:
        self.max_bytes = int(max_body_mb * 2**20)
        self.max_drain_bytes = max(DRAIN_FACTOR * self.max_bytes, DRAIN_MIN_BYTES)

    async def read(self, scope: Scope, receive: Receive) -> bytes:
        """The body, or a 413 the client can read (see the module's docstring).

        Raises:
            ProtocolError: 413 for a body over the bound, 400 when the client left before its end.
        """
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= self.max_drain_bytes:
                await drain(receive, int(declared))
            raise self._too_large(f"the body has {declared} bytes")
        chunks, size = [], 0
        while True:  # a chunked body declares no length: count it
            message = await receive()
            if message["type"] == "http.disconnect":  # gone, or cut off by the transport's read timeout
                raise ProtocolError(400, "the client closed the connection before the whole body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await drain(receive, self.max_drain_bytes - size)
                raise self._too_large(f"the body has more than {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def of_request(self, request: Request) -> bytes:
        """``read`` of a Starlette request."""
        return await self.read(request.scope, request.receive)

    def _too_large(self, what: str) -> ProtocolError:
        return ProtocolError(
            413, f"{what}; the limit is {self.max_bytes} bytes (--max-body-mb)", {"Connection": "close"}
        )


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of the request header ``name`` (lower case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def drain(receive: Receive, limit_bytes: int, timeout_s: float = DRAIN_S) -> None:
    """Read and drop the rest of a request body: up to ``limit_bytes``, for at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(asyncio.TimeoutError):
        while limit_bytes > 0:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
            limit_bytes -= len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
