"""gRPC client channels with OpenTelemetry propagation.

Contract: :func:`channel` returns a ``grpc.aio`` insecure channel to ``address`` whose calls
create client spans and carry the current trace context (opentelemetry-instrumentation-grpc
interceptors). Channels are cheap to keep; callers cache one per address.
"""

from __future__ import annotations

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]


def channel(address: str) -> grpc.aio.Channel:
    """An instrumented insecure channel to ``host:port``."""
    return grpc.aio.insecure_channel(
        address, options=_OPTIONS, interceptors=aio_client_interceptors()
    )


class ChannelPool:
    """One channel per address, closed together."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        """The cached channel to ``address`` (created on first use)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return ch

    async def drop(self, address: str) -> None:
        """Closes and forgets the channel to ``address`` if any."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def keep_only(self, addresses: set[str]) -> None:
        """Closes and forgets every channel whose address is not in ``addresses``."""
        for address in [a for a in self._channels if a not in addresses]:
            await self.drop(address)

    async def close(self) -> None:
        """Closes all channels."""
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
