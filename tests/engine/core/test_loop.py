"""CoreLoop, the engine core's turn, over a recording engine: command order, parked grammars, aborts, stop."""

from __future__ import annotations

from engine.core.arena import ALIGN, Arena
from engine.core.loop import PARKED_POLL_S, CoreLoop
from engine.core.messages import Abort, AddRequest, Stop
from engine.outputs import CompletionDelta, RequestDelta
from engine.sampling_params import SamplingParams
from engine.structured.spec import Guide


class Grammars:
    def __init__(self):
        self.compiled: set[str] = set()

    def ready(self, guide) -> bool:
        return guide.key in self.compiled


class Engine:
    """What CoreLoop uses of LLMEngine, recording the calls."""

    def __init__(self):
        self.grammars = Grammars()
        self.running: list[str] = []
        self.calls: list[tuple] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def make_sequence(self, rid, prompt, params, salt, arrival):
        if prompt == [0]:
            raise ValueError("refused")
        return rid

    def add_sequence(self, rid) -> None:
        self.calls.append(("add", rid))
        self.running.append(rid)

    def abort_request(self, rid):
        self.calls.append(("abort", rid))
        if rid not in self.running:
            return None
        self.running.remove(rid)
        return RequestDelta(rid, [CompletionDelta(0, finish_reason="abort")], True, 1)

    def stop_completion(self, rid, index):
        self.calls.append(("stop", rid, index))

    def abort_all(self):
        return [out for rid in list(self.running) if (out := self.abort_request(rid)) is not None]

    def step(self):
        self.calls.append(("step", tuple(self.running)))
        return [RequestDelta(rid, [CompletionDelta(0, "x", [7])], False, 1) for rid in self.running]

    def drain_kv_events(self):
        return []

    def stats(self):
        return "stats"


ARENA = Arena(ALIGN)  # no transfers here


def add(rid: str, guide: Guide | None = None, prompt=(5, 6)) -> AddRequest:
    return AddRequest(rid, list(prompt), SamplingParams(guide=guide), None, 1.0)


def test_adds_then_one_step_in_order_and_the_wait_follows_the_work():
    eng = Engine()
    core = CoreLoop(eng, ARENA)
    assert core.wait_timeout is None  # idle: block until a command
    rep = core.turn([add("a"), add("b")])
    assert eng.calls == [("add", "a"), ("add", "b"), ("step", ("a", "b"))]
    assert [o.request_id for o in rep.outputs] == ["a", "b"] and rep.stats == "stats" and not rep.stopped
    assert core.wait_timeout == 0.0  # work to do: do not wait


def test_a_request_whose_grammar_is_not_compiled_waits_parked_and_keeps_its_place():
    eng = Engine()
    core = CoreLoop(eng, ARENA)
    guide = Guide.json_object("response_format")
    core.turn([add("a", guide), add("b")])
    assert eng.calls == [("add", "b"), ("step", ("b",))]
    eng.running.clear()
    assert core.wait_timeout == PARKED_POLL_S  # only a parked request: look again soon
    eng.grammars.compiled.add(guide.key)
    core.turn([])
    assert eng.calls[-2:] == [("add", "a"), ("step", ("a",))]


def test_an_abort_reaches_a_parked_request_without_the_engine():
    eng = Engine()
    core = CoreLoop(eng, ARENA)
    core.turn([add("a", Guide.json_object("response_format"))])
    rep = core.turn([Abort("a")])
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in rep.outputs] == [("a", True, "abort")]
    assert ("abort", "a") not in eng.calls and core.wait_timeout is None


def test_a_refused_add_is_reported_for_its_request_only():
    eng = Engine()
    rep = CoreLoop(eng, ARENA).turn([add("bad", prompt=[0]), add("ok")])
    assert [(rid, str(e)) for rid, e in rep.errors] == [("bad", "refused")]
    assert eng.calls == [("add", "ok"), ("step", ("ok",))]


def test_stop_aborts_parked_and_running_and_runs_no_step():
    eng = Engine()
    core = CoreLoop(eng, ARENA)
    core.turn([add("a"), add("p", Guide.json_object("response_format"))])
    rep = core.turn([Stop()])
    assert rep.stopped
    assert sorted(o.request_id for o in rep.outputs) == ["a", "p"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in rep.outputs)
    assert eng.calls[-1] == ("abort", "a")


def test_an_abort_naming_a_completion_stops_only_it_and_reports_nothing():
    eng = Engine()
    core = CoreLoop(eng, ARENA)
    core.turn([add("a")])
    rep = core.turn([Abort("a", 1)])  # a stop string ended completion 1 in the front end
    assert ("stop", "a", 1) in eng.calls and ("abort", "a") not in eng.calls
    assert [o.outputs[0].finish_reason for o in rep.outputs] == [None]  # a runs on: only its step's delta
