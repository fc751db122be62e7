"""Admission, queue and stop rules of the built-in engine (pure)."""

from __future__ import annotations

from relax.engines.builtin.sampling import SamplingParams
from relax.engines.builtin.scheduler import Capacity, Request, RequestQueue, admit, check_stop


def _req(rid: str, prompt: int = 4, max_new: int = 4, parent: str | None = None, **params) -> Request:
    return Request(rid=rid, parent_rid=parent or rid, prompt_ids=list(range(prompt)),
                   params=SamplingParams(max_new_tokens=max_new, **params), arrival=0.0)


def test_admit_respects_slots_in_fifo_order() -> None:
    waiting = [_req(f"r{i}") for i in range(5)]
    chosen = admit(waiting, running=[_req("busy")], capacity=Capacity(3, 10_000))
    assert [r.rid for r in chosen] == ["r0", "r1"]


def test_admit_reserves_worst_case_tokens() -> None:
    running = [_req("busy", prompt=10, max_new=10)]  # 20 reserved
    waiting = [_req("a", prompt=5, max_new=5), _req("b", prompt=5, max_new=5), _req("c", prompt=1, max_new=1)]
    chosen = admit(waiting, running, Capacity(10, 32))
    assert [r.rid for r in chosen] == ["a"]  # b would need 10 more of the 2 left; c waits behind it


def test_admit_nothing_when_full() -> None:
    assert admit([_req("a")], [_req("x"), _req("y")], Capacity(2, 1000)) == []


def test_queue_push_front_keeps_turn_and_pop_matching_by_parent() -> None:
    q = RequestQueue()
    q.push(_req("late"))
    q.push_front([_req("p-0", parent="p"), _req("p-1", parent="p")])
    assert [r.rid for r in q] == ["p-0", "p-1", "late"]
    popped = q.pop_matching("p")
    assert [r.rid for r in popped] == ["p-0", "p-1"]
    assert [r.rid for r in q] == ["late"]
    assert [r.rid for r in q.pop_matching(None)] == ["late"] and len(q) == 0


def test_stop_on_eos_unless_ignored() -> None:
    req = _req("a")
    req.output_ids = [7]
    assert check_stop(req, 7, "x", frozenset({7}))[0] == {"type": "stop", "matched": 7}
    ignoring = _req("b", ignore_eos=True)
    ignoring.output_ids = [7]
    assert check_stop(ignoring, 7, "x", frozenset({7}))[0] is None


def test_stop_string_is_trimmed_unless_no_stop_trim() -> None:
    req = _req("a", stop=("END",))
    req.output_ids = [1, 2]
    reason, text = check_stop(req, 2, "hello END", frozenset())
    assert reason == {"type": "stop", "matched": "END"} and text == "hello "
    keep = _req("b", stop=("END",), no_stop_trim=True)
    keep.output_ids = [1]
    assert check_stop(keep, 1, "hello END", frozenset())[1] == "hello END"


def test_length_limit() -> None:
    req = _req("a", max_new=2)
    req.output_ids = [1]
    assert check_stop(req, 1, "a", frozenset())[0] is None
    req.output_ids = [1, 2]
    assert check_stop(req, 2, "ab", frozenset())[0] == {"type": "length", "length": 2}


def test_stop_token_ids() -> None:
    req = _req("a", stop_token_ids=(9,))
    req.output_ids = [9]
    assert check_stop(req, 9, "", frozenset())[0] == {"type": "stop", "matched": 9}
