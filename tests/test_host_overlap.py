"""Host work while a denoise call runs (``EngineConfig.host_overlap``, dllm_jax/engine/rounds.py; issue 39 item 6).

Requests that arrive while a call runs are admitted and prefilled before that call is read; consumers get the
previous round's events meanwhile. Nothing the call in flight uses may change under it: an abort waits for the
round's end, admission never retracts a running request, a failing consumer's request fails after the commit.
Every request finishes token for token as it does alone, and every page comes back.
"""

from __future__ import annotations

import pytest

from conftest import ENGINE_KW, assert_pages_back

LONG = {"max_new_tokens": 24, "ignore_eos": True}
FIRST = [5, 6, 7, 8, 9, 10]
LATE = [list(range(2, 30)), [11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23]]


@pytest.fixture(scope="module")
def alone(tiny_model):
    """Each prompt's output run alone, without host overlap."""
    from dllm_jax import Engine

    engine = Engine(tiny_model, host_overlap=False, **ENGINE_KW)
    return {tuple(p): engine.generate(input_ids=p, sampling_params=LONG)["output_ids"] for p in [FIRST, *LATE]}


class Spy:
    """Records what ``Scheduler.schedule_ahead`` planned, and any retraction made while it ran."""

    def __init__(self, scheduler):
        self.prefills, self.retracted_ahead, self.inside = [], 0, False
        plan, retract = scheduler.schedule_ahead, scheduler.retract

        def schedule_ahead():
            self.inside = True
            try:
                call = plan()
            finally:
                self.inside = False
            if call is not None:
                self.prefills.append([len(r.real_ids) for r in call.reqs])
            return call

        def retract_spy(req):
            self.retracted_ahead += self.inside
            return retract(req)

        scheduler.schedule_ahead, scheduler.retract = schedule_ahead, retract_spy


def _run(engine, first_event):
    """Submit FIRST; its consumer calls ``first_event(engine, req)`` once, on its first event (while the next
    denoise call runs, under host overlap); step until nothing is left."""
    calls = []

    def on_event(req, event):
        if not calls:
            calls.append(first_event(engine, req))

    req = engine.make_request(FIRST, LONG, on_event=on_event, provisional=True)
    engine.submit(req)
    for _ in range(2000):
        if not engine.step():
            break
    assert req.finished
    return req, calls[0]


def _submit_late(engine, _req):
    late = [engine.make_request(p, LONG) for p in LATE]
    for r in late:
        engine.submit(r)
    return late


def test_requests_arriving_while_a_call_runs_are_prefilled_meanwhile(tiny_model, make_engine, alone):
    engine = make_engine(tiny_model, **ENGINE_KW)
    assert engine.host_overlap and engine.engine_config.host_overlap
    spy = Spy(engine.scheduler)
    first, late = _run(engine, _submit_late)
    # Late requests were admitted and their prompts encoded while FIRST's denoise call ran (one row per
    # prefill call at these buckets: the longest first; the others in the rounds after).
    assert spy.prefills and spy.prefills[0] == [len(LATE[0])], spy.prefills
    assert first.output_ids == alone[tuple(FIRST)]
    assert [r.output_ids for r in late] == [alone[tuple(p)] for p in LATE]
    assert all(r.finish_reason["type"] == "length" for r in [first, *late])
    assert_pages_back(engine)


def test_off_switch_does_all_host_work_between_calls(tiny_model, make_engine, alone):
    engine = make_engine(tiny_model, host_overlap=False, **ENGINE_KW)
    spy = Spy(engine.scheduler)
    first, late = _run(engine, _submit_late)
    assert spy.prefills == []
    assert [r.output_ids for r in [first, *late]] == [alone[tuple(p)] for p in [FIRST, *LATE]]
    assert_pages_back(engine)


def test_an_abort_taken_in_while_a_call_runs_waits_for_its_commit(tiny_model, make_engine, alone):
    engine = make_engine(tiny_model, **ENGINE_KW)
    victim = engine.make_request(LATE[0], LONG)
    engine.submit(victim)
    seen = {}

    def abort_victim(engine, req):
        seen["running"] = victim in engine.scheduler.running  # in the call in flight
        seen["pages"] = list(victim.pages)
        engine.abort(victim)
        seen["held"] = not victim.finished  # not aborted under the call
        return None

    first, _ = _run(engine, abort_victim)
    assert seen == {"running": True, "pages": seen["pages"], "held": True} and seen["pages"]
    assert victim.finish_reason["type"] == "abort"
    assert first.output_ids == alone[tuple(FIRST)]
    assert_pages_back(engine)


def test_admission_while_a_call_runs_never_retracts(tiny_model, make_engine, alone):
    """A pool too small for all: the late requests wait (or are retracted between rounds, as without host
    overlap), never while a call uses the pages; every output is still the one run alone."""
    engine = make_engine(tiny_model, **{**ENGINE_KW, "num_kv_pages": 16})
    spy = Spy(engine.scheduler)
    first, late = _run(engine, _submit_late)
    assert engine.scheduler.stats["retractions"] > 0 and spy.retracted_ahead == 0
    assert [r.output_ids for r in [first, *late]] == [alone[tuple(p)] for p in [FIRST, *LATE]]
    assert_pages_back(engine)


def test_a_consumer_failing_while_a_call_runs_fails_its_request_after_the_commit(tiny_model, make_engine, alone):
    engine = make_engine(tiny_model, **ENGINE_KW)
    other = engine.make_request(LATE[1], LONG)
    engine.submit(other)
    states = []

    def broken(req, event):
        states.append(req in engine.scheduler.running)
        raise RuntimeError("consumer gone")

    bad = engine.make_request(LATE[2], LONG, on_event=broken, provisional=True)
    engine.submit(bad)
    first, _ = _run(engine, lambda engine, req: None)
    assert bad.finish_reason["type"] == "abort" and "consumer gone" in bad.finish_reason["message"]
    assert states and states[0]  # it failed while running (its event went out while a call ran)
    assert first.output_ids == alone[tuple(FIRST)] and other.output_ids == alone[tuple(LATE[1])]
    assert_pages_back(engine)


def test_a_request_finishing_with_events_waiting_is_seen_finished_once(tiny_model, make_engine):
    """Events wait for the next call; a request aborted meanwhile gets its finish event alone (the waiting ones
    would show it finished too: a consumer counting finishes counted two, as the server's metrics did)."""
    engine = make_engine(tiny_model, **ENGINE_KW)
    seen = []
    req = engine.make_request(LATE[0], LONG, on_event=lambda r, e: seen.append((r.finished, bool(e))))
    engine.submit(req)
    while not engine.scheduler.deferred_events:  # a round left a committed block's event for the next call
        assert engine.step()
    waiting = len(engine.scheduler.deferred_events)
    engine.abort(req)
    engine.step()
    assert req.finish_reason["type"] == "abort" and waiting >= 1
    assert [finished for finished, _ in seen].count(True) == 1 and seen[-1][0]
    assert_pages_back(engine)
