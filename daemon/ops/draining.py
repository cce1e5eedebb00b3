"""The API server of a stopping node: uvicorn's, noting when the stop signal came."""

from __future__ import annotations

import logging
import time

import uvicorn

log = logging.getLogger("ringlet.daemon.ops.runner")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, noting when a stop signal came: on SIGTERM or SIGINT it stops
    accepting connections and waits up to ``timeout_graceful_shutdown`` seconds for the
    requests in flight (streams included) before :func:`serve` leaves the cluster."""

    stopping_at: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.stopping_at is None:
            self.stopping_at = time.monotonic()
            log.info("stopping (signal %d): draining the API requests in flight", sig)
        # streams that are no request (the web console's live view) end at once rather than hold the drain
        state = getattr(getattr(self.config, "app", None), "state", None)
        if state is not None:
            state.stopping = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it has shut down, which would kill
        # the process before it leaves the cluster; the daemon exits by itself instead
        self._captured_signals.clear()
