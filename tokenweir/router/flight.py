"""One request forwarded to one replica: the upstream exchange runs in a task of its own that
hands what it receives to a queue, so that the replica failing (ReplicaSet.take_out, from the
health checks) can end it at once, whatever the forwarder is waiting on.

The queue holds, in order: one `Start` (status and headers), the body's chunks (bytes), then
`END` or one `Failure`. Nothing follows a Failure or END.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional, Union

import httpx

from tokenweir.router.replicas import Replica, describe


@dataclass(frozen=True)
class Start:
    status: int
    headers: httpx.Headers


@dataclass(frozen=True)
class Failure:
    reason: str
    connected: bool  # False: the replica could not be reached (or failed before answering)


END = object()
Item = Union[Start, bytes, Failure, object]


class Flight:
    def __init__(self, client: httpx.AsyncClient, replica: Replica, request: httpx.Request):
        self.replica = replica
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._reason: Optional[str] = None
        self._started = False
        replica.flights.add(self)
        self._task = asyncio.create_task(self._pump(client, request))

    async def next(self) -> Item:
        return await self._queue.get()

    def fail(self, reason: str) -> None:
        """End the exchange: the forwarder's next read after what is queued is a Failure."""
        if self._reason is None:
            self._reason = reason
            self._task.cancel()

    async def close(self) -> None:
        """Stop reading (done, or the client left): the replica sees the connection close,
        which aborts the request there."""
        self.replica.flights.discard(self)
        self._reason = self._reason or "closed"
        self._task.cancel()
        try:  # shielded: when the caller is cancelled, awaiting the task would cancel it again
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            pass

    async def _pump(self, client: httpx.AsyncClient, request: httpx.Request) -> None:
        response = None
        try:
            response = await client.send(request, stream=True)
            self._started = True
            self._queue.put_nowait(Start(response.status_code, response.headers))
            async for chunk in response.aiter_raw():
                self._queue.put_nowait(chunk)
            self._queue.put_nowait(END)
        except asyncio.CancelledError:
            self._queue.put_nowait(Failure(self._reason or "cancelled", self._started))
            raise
        except httpx.HTTPError as exc:
            self._queue.put_nowait(Failure(describe(exc), self._started))
        finally:
            self.replica.flights.discard(self)
            if response is not None:  # shielded: a second cancel must not leave it open
                await asyncio.shield(response.aclose())
