"""What the routes share: the engine, the settings, the metrics registry and the drain state.

One `AppState` per app, stored as `app.state.tokenweir`; routes reach it with `app_state()`.
Everything here runs on the event loop; the heavy parts (tokenizing, templating) are handed to
threads by AsyncEngine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Request
from prometheus_client import CollectorRegistry

from tokenweir.engine.async_engine import AsyncEngine, EngineDeadError, HopelessRequestError
from tokenweir.server.errors import APIError
from tokenweir.server.settings import ServerSettings

if TYPE_CHECKING:
    from tokenweir.timeline.records import StepRing

logger = logging.getLogger("tokenweir.server")


@dataclass
class AppState:
    engine: AsyncEngine
    settings: ServerSettings
    registry: CollectorRegistry
    draining: bool = False
    timeline: Optional["StepRing"] = None  # recent steps for GET /timeline (None: off)
    _drained: asyncio.Event = field(default_factory=asyncio.Event)

    def model_name(self, requested: Any) -> str:
        """The served name a request asked for (default: the first); 400 for any other."""
        names = self.settings.served_model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(f"the model '{requested}' does not exist; this server serves "
                           f"{list(names)}", 400, param="model", code="model_not_found")
        return requested

    def admit(self) -> None:
        """503 + Retry-After while draining, stopped, or with too many waiting."""
        if self.draining or not self.engine.is_running:
            raise APIError(self.engine.death or "the server is shutting down", 503,
                           "service_unavailable", headers={"Retry-After": "5"})
        limit = self.settings.max_waiting_requests
        waiting = self.engine.num_unstarted
        if limit is not None and waiting >= limit:
            raise APIError(f"too many waiting requests ({waiting} >= {limit}); retry later",
                           503, "service_unavailable", headers={"Retry-After": "1"})

    async def submit(self, prompt: Any, parsed: Any, request_id: str) -> asyncio.Queue:
        """Admit, tokenize (off the loop) and queue a request; the queue of its outputs."""
        self.admit()
        try:
            return await self.engine.add(prompt, parsed.params, request_id, parsed.priority,
                                         parsed.ttft_slo_ms,
                                         reject_hopeless=self.settings.slo_reject_hopeless,
                                         tpot_slo_ms=parsed.tpot_slo_ms)
        except HopelessRequestError as exc:  # shed: a faster replica (or a later try) may serve
            raise APIError(str(exc), 503, "service_unavailable", param="ttft_slo_ms",
                           headers={"Retry-After": "1"}) from exc
        except ValueError as exc:
            param = "max_tokens" if str(exc).startswith("max_tokens=") else "prompt"
            raise APIError(str(exc), param=param) from exc
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable",
                           headers={"Retry-After": "5"}) from exc

    async def drain(self) -> None:
        """Stop admitting; let in-flight requests run for up to `drain_timeout` seconds, then
        end each one with finish_reason 'abort' (streams get a final chunk and [DONE]).
        Idempotent: a second call waits for the first."""
        if self.draining:
            await self._drained.wait()
            return
        self.draining = True
        timeout = self.settings.drain_timeout
        if not await self.engine.drain(timeout):
            cut = self.engine.abort_all()
            logger.warning("drain timeout (%.1f s): ending %d request(s) with "
                           "finish_reason 'abort'", timeout, cut)
            await self.engine.drain(5.0)
        self._drained.set()


def app_state(request: Request) -> AppState:
    return request.app.state.tokenweir
