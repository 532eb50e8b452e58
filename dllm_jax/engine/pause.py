"""Pausing generation (SGLang's ``pause_generation`` / ``continue_generation``), for RL rollouts that swap weights
between rollout phases without restarting the engine.

A mixin of :class:`dllm_jax.engine.engine.Engine`: while paused, ``Engine.step`` drains the inbox (new requests
queue in the scheduler's waiting list, never refused) but plans no device call. The modes say what happens to the
requests in flight when the pause begins:

* ``"abort"``: every request in flight (running or queued) ends now with the output it has, ``finish_reason``
  ``{"type": "abort", "message": PAUSE_ABORT_MESSAGE}``;
* ``"retract"``: running requests give their KV pages back and return to the front of the queue keeping their
  committed tokens (their complete blocks stay in the prefix cache unless it is flushed); the block being decoded
  is dropped. On resume they are re-admitted and re-encoded like any retracted request, so with the weights
  unchanged they write the same tokens as an uninterrupted run;
* ``"in_place"``: running requests keep their pages, their partly decoded block and its state, and continue from
  there with whatever weights are loaded at resume: their KV and committed tokens may come from older weights
  (mixed versions). Their KV pins the prefix cache, so a cache flush is refused meanwhile.
"""

from __future__ import annotations

PAUSE_MODES = ("abort", "retract", "in_place")
PAUSE_ABORT_MESSAGE = "generation paused (pause_generation mode 'abort')"


class PauseGeneration:
    pause_mode: str | None = None  # None: generating; else the mode of the pause in force

    def pause_generation(self, mode: str = "abort") -> dict:
        """Stop scheduling device calls until :meth:`continue_generation`; ``mode`` (see the module's doc) says
        what happens to the requests in flight. Returns the counts of requests ended, parked and queued. Pausing a
        paused engine applies the new mode to what is in flight (``retract`` after ``in_place`` retracts)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._require_scheduler("pause_generation")
        with self._lock:
            self._drain_inbox()
            s = self.scheduler
            ended = 0
            if mode == "abort":
                ended = self._abort_in_flight(PAUSE_ABORT_MESSAGE)
            elif mode == "retract":
                for req in reversed(list(s.running)):  # the earliest admitted ends up first in the queue
                    s.retract(req)
            self.pause_mode = mode
            return {"mode": mode, "aborted": ended, "parked": len(s.running), "queued": len(s.waiting)}

    def continue_generation(self) -> dict:
        """Resume scheduling: retracted requests are re-admitted first, parked ones continue in place."""
        self._require_scheduler("continue_generation")
        self._check_occupied("continue_generation")
        with self._lock:
            was, self.pause_mode = self.pause_mode, None
        self._wakeup.set()
        return {"resumed": was is not None}

    def _abort_in_flight(self, message: str) -> int:
        """End every running and queued request with its output so far (call with the lock held)."""
        self._drain_inbox()
        s = self.scheduler
        reqs = list(s.running) + list(s.waiting)
        for req in reqs:
            s.abort(req, message=message)
        return len(reqs)

    def parked_in_place(self) -> int:
        """Requests paused in place: they hold KV pages (and so pin the prefix cache)."""
        return len(self.scheduler.running) if self.pause_mode == "in_place" else 0

    def flush_refusal(self) -> str | None:
        """Why a cache flush is refused now, if it is because requests are parked in place: their KV pins cache
        entries that would survive the flush (and serve new requests K/V of the old weights)."""
        parked = self.parked_in_place()
        if not parked:
            return None
        return (f"{parked} request(s) are paused in place and hold KV pages; continue_generation() first, or pause "
                f"with mode 'retract' or 'abort' to flush the cache")

    def _check_flush(self, field: str = "flush_cache", error=RuntimeError) -> None:
        refusal = self.flush_refusal()
        if refusal:
            raise error(f"{field}: {refusal}")

    def _require_scheduler(self, what: str) -> None:
        """Pausing and weight updates need the family's capability (``Engine.capabilities``)."""
        from dllm_jax.model.family import family_of

        if getattr(self, "runner", None) is None:
            raise RuntimeError(f"{what}: this engine loads its model but cannot decode it yet")
        if not self.capabilities.rl:
            raise NotImplementedError(f"{what}: not implemented for {family_of(self.config).name} models yet")
