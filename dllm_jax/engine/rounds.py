"""One scheduler round of the :class:`~dllm_jax.engine.engine.Engine`: plan -> run -> commit, and the host work
done while a device call runs.

A round drains the inbox (requests and aborts other threads queued), then runs each call the scheduler plans
(``Scheduler.schedule``: a prefill, then a denoise call) and commits its result (``Scheduler.process``).

**Host overlap** (``EngineConfig.host_overlap``, on by default): JAX dispatch is asynchronous, so once the denoise
call is dispatched the host is free until it reads the call's results, the one read the schedule needs (which
rows finished, their tokens). In that window it does the work that does not depend on that call: the previous
round's events go to their consumers (stream chunks are built and detokenized there; committing only queues
them), new requests are taken in, admitted and prefilled (``Scheduler.schedule_ahead``; the device queues the
prefill behind the call in flight, and the next round's denoise call takes those requests in). What the call in
flight may be using is never touched meanwhile: aborts wait for the round's end, no running request is retracted
for pages, and a consumer that fails has its request failed only once the call is committed. Measured by
``bench/roofline.py``'s ``OverlapProbe`` (host time per call hidden vs exposed).
"""

from __future__ import annotations

import queue

import jax

from dllm_jax.engine.calls import Failed
from dllm_jax.engine.request import Request


class Rounds:
    """Part of :class:`~dllm_jax.engine.engine.Engine` (reads its scheduler, runner, inbox and lock)."""

    _ran_ahead = False  # this round did host work while its denoise call ran (_while_running)
    _ahead_error: BaseException | None = None  # raised by that work; raised once the call is committed

    def _drain_inbox(self, aborts: bool = True) -> None:
        """Take in the requests and aborts other threads queued. ``aborts=False`` (while a call runs): aborts
        are held until the next drain, since the call in flight may be using the pages an abort frees."""
        if aborts:
            held, self._held_aborts = self._held_aborts, []
            for item in held:
                self._abort_now(item)
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                item.weight_version = self.weight_version
                self._requests[item.rid] = item
                self.scheduler.add(item)
            elif aborts:
                self._abort_now(item)
            else:
                self._held_aborts.append(item)

    def _abort_now(self, item: Request | str) -> None:
        req = item if isinstance(item, Request) else self._requests.get(item)
        if req is not None:
            self.scheduler.abort(req)

    def _while_running(self) -> None:
        """Host work that does not depend on the denoise call in flight, done while the device runs it
        (``host_overlap``): the previous round's events go to their consumers (stream chunks are detokenized
        here), then new requests are taken in, admitted and prefilled (:meth:`Scheduler.schedule_ahead`). An
        error is raised once the call in flight is committed, never as the call's own."""
        self._ran_ahead = True
        try:
            self.scheduler.deliver_events(in_flight=True)
            self._drain_inbox(aborts=False)
            call = self.scheduler.schedule_ahead()
            if call is not None:
                self._run_and_process(call)
        except BaseException as e:
            self._ahead_error = e

    def _run_and_process(self, call, overlap: bool = False) -> None:
        """Dispatch -> host work while the device runs (``overlap``: a denoise call) -> collect -> commit."""
        try:
            pending = self.runner.dispatch(call)
            if overlap and pending.in_flight:
                with jax.profiler.TraceAnnotation("while_running"):
                    self._while_running()
            result = self.runner.collect(pending)
        except BaseException as e:
            result = Failed(e)
        self.scheduler.process(call, result)  # commit

    def step(self) -> bool:
        """One scheduler round (drains the inbox first). Returns whether there is more work."""
        with self._lock:
            self._drain_inbox()
            if self.failure is not None:
                self._fail_all(RuntimeError(self.failure))
            elif self.scheduler.has_work() and self.pause_mode is None:  # paused: requests queue (pause.py)
                self.scheduler.deferring = self.host_overlap  # events go out while the next call runs
                self._ran_ahead = False
                with jax.profiler.StepTraceAnnotation("engine_step", step_num=self._steps):
                    try:
                        for call in self.scheduler.schedule():  # plan
                            self._run_and_process(call, overlap=self.host_overlap)
                            self.scheduler.fail_consumers()
                            if self._ahead_error is not None:
                                error, self._ahead_error = self._ahead_error, None
                                raise error
                    except Exception as e:  # multi-process: a failed call is the group's failure
                        if self.runner.channel is None:
                            raise
                        raise self._group_failed(e) from e
                    finally:
                        self.scheduler.deferring = False
                self._steps += 1
                if self._profiling and self._profile_steps and self._steps >= self._profile_stop_at:
                    self.stop_profile()
            if not (self._ran_ahead and self.scheduler.has_work() and self.pause_mode is None):
                self.scheduler.deliver_events()  # no call runs next to hand them over while it runs
            self._ran_ahead = False
            for rid in [rid for rid, r in self._requests.items() if r.finished]:
                del self._requests[rid]
            return self.pause_mode is None and (self.scheduler.has_work() or not self._inbox.empty())
