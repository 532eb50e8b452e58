"""Handing a request's events to its consumer: committed chunks, the finish, provisional steps.

With host overlap (the engine's ``host_overlap``) the scheduler defers them while it commits and the engine hands
them over while the next device call runs (:meth:`Events.deliver_events`); a consumer that fails meanwhile has its
request failed only once that call is committed (the call may be writing the request's pages).

:class:`Events` is a part of :class:`dllm_jax.engine.scheduler.Scheduler` (it calls the scheduler's ``fail``).
"""

from __future__ import annotations

import logging

from dllm_jax.engine.request import Request

log = logging.getLogger("dllm_jax")
PROVISIONAL = {"provisional": True}  # the event of a denoise step that left the block unfinished


class Events:
    # While ``deferring``, events wait in ``deferred_events`` (lists per scheduler: Scheduler.__init__).
    deferring: bool = False
    deferred_events: list | tuple = ()
    consumer_failures: list | tuple = ()

    def emit(self, req: Request, event: dict | None = None) -> None:
        """Hand the request's consumer an event: now, after the events still waiting (their order is kept), or,
        while ``deferring``, later."""
        if req.on_event is None:
            return
        if req.finished and self.deferred_events:  # its finish event carries all its waiting ones hold
            self.deferred_events = [(r, e) for r, e in self.deferred_events if r is not req]
        if self.deferring:
            self.deferred_events.append((req, event or {}))
            return
        self.deliver_events()
        self._deliver(req, event or {}, in_flight=False)

    def deliver_events(self, *, in_flight: bool = False) -> None:
        """Hand over the events waiting (consumers read the request's state then, which no commit changed
        since; a provisional event whose block is gone, the request retracted since, is dropped).
        ``in_flight``: a device call runs, and a consumer that fails only has its failure noted
        (``consumer_failures``)."""
        events, self.deferred_events = self.deferred_events, []
        for req, event in events:
            if event.get("provisional") and getattr(req, "block_tokens", None) is None:
                continue
            self._deliver(req, event, in_flight=in_flight)

    def _deliver(self, req: Request, event: dict, *, in_flight: bool) -> None:
        try:
            req.on_event(req, event)
        except Exception as e:  # the consumer's failure is its request's, never the loop's
            if req.finished:
                log.exception("request %s: its on_event callback failed after it finished", req.rid)
            elif in_flight:
                self.consumer_failures.append((req, e))
            else:
                self.fail(req, e)

    def fail_consumers(self) -> None:
        """Fail the requests whose consumer failed while a device call ran (see :meth:`deliver_events`)."""
        failures, self.consumer_failures = self.consumer_failures, []
        for req, error in failures:
            if not req.finished:
                self.fail(req, error)
