"""The built-in engine's generation loop yields to callers between steps (a fair lock hand-off).

A real Engine on the tiny preset model whose steps pass a gate the test controls: the loop is held inside
a step (holding the engine lock) while a caller queues for the lock, then given many steps' worth of
permits at once. A fair loop finishes the step in progress and lets the caller in; an unfair one keeps
stepping. Counted in steps, never in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from relax.engines.builtin.engine import Engine
from relax.engines.builtin.metrics import EngineMetrics
from relax.engines.builtin.model_runner import ModelRunner, load_model
from relax.engines.builtin.sampling import SamplingParams
from relax.engines.builtin.scheduler import Capacity, Request
from relax.weights.pause_mode import PauseMode


class Gate:
    """Every forward pass waits for a permit; ``entered`` counts the passes that reached the gate."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.entered = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered += 1
            if not self.permits.acquire(timeout=60):
                raise TimeoutError("the test never opened the gate")
            return fn(*args, **kwargs)

        return gated


def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.fixture
def gated(tiny_preset) -> Iterator[tuple[Engine, Gate]]:
    gate = Gate()
    device = torch.device("cpu")
    runner = ModelRunner(load_model(tiny_preset.model_dir, device), device, pad_token_id=0)
    runner.decode = gate.wrap(runner.decode)  # type: ignore[method-assign]
    runner.prefill = gate.wrap(runner.prefill)  # type: ignore[method-assign]
    engine = Engine(runner, decode=lambda ids, skip: "", eos_token_ids=frozenset(), capacity=Capacity(4, 4096),
                    metrics=EngineMetrics("tiny"))
    engine.start()
    yield engine, gate
    gate.permits.release(10_000)  # never leave the loop stuck at the gate
    engine.stop()


def _hold_inside_a_step(engine: Engine, gate: Gate, done: threading.Event) -> None:
    """Submit one long request, let 3 steps run, and stop the loop inside the 4th (lock held)."""
    engine.submit([Request(rid="long", parent_rid="long", prompt_ids=[1, 2, 3],
                           params=SamplingParams(max_new_tokens=200, ignore_eos=True),
                           arrival=time.monotonic(), on_finish=lambda _req: done.set())])
    gate.permits.release(3)
    _until(lambda: gate.entered == 4 and engine._steps == 3, "the loop to reach its 4th step")


@pytest.mark.parametrize("call", ["pause", "stats", "abort"])
def test_a_caller_waits_for_the_step_in_progress_only(gated: tuple[Engine, Gate], call: str) -> None:
    engine, gate = gated
    done = threading.Event()
    _hold_inside_a_step(engine, gate, done)
    seen: list[int] = []
    calls = {
        "pause": lambda: engine.pause(PauseMode.IN_PLACE),
        "stats": lambda: seen.append(engine.stats().steps),  # read under the lock: the step count it got in at
        "abort": lambda: engine.abort("long"),
    }
    caller = threading.Thread(target=calls[call])
    caller.start()
    _until(lambda: engine._callers_waiting == 1, "the caller to queue for the lock")
    steps_before = engine._steps
    gate.permits.release(50)  # the loop could take 50 more steps if it kept the lock to itself
    caller.join(60)
    assert not caller.is_alive()
    if call == "stats":  # the reader got in right after the step in progress; the loop then carries on
        assert seen == [steps_before + 1]
        _until(lambda: engine._steps > steps_before + 1, "the loop to carry on")
    else:  # paused or aborted right after the step in progress
        assert engine._steps == steps_before + 1
    if call == "pause":
        assert engine.snapshot().num_running_reqs == 1
        engine.resume()
    gate.permits.release(1000)
    assert done.wait(60)


def test_the_counter_returns_to_zero_when_a_caller_fails(gated: tuple[Engine, Gate]) -> None:
    engine, _gate = gated
    engine.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([])
    assert engine._callers_waiting == 0



def test_submit_and_snapshot_never_wait_for_the_step_in_progress(gated: tuple[Engine, Gate]) -> None:
    """The loop is held inside a step (lock held, no permits): a submit and a /metrics snapshot still return,
    the newcomer is counted as queued, a duplicate rid is refused, and the newcomer runs once steps go on."""
    from relax.engines.builtin.engine import DuplicateRequestId

    engine, gate = gated
    done = threading.Event()
    _hold_inside_a_step(engine, gate, done)
    joined = threading.Event()
    caller = threading.Thread(target=lambda: engine.submit([Request(
        rid="new", parent_rid="new", prompt_ids=[4, 5], params=SamplingParams(max_new_tokens=2, ignore_eos=True),
        arrival=time.monotonic(), on_finish=lambda _req: joined.set())]))
    caller.start()
    caller.join(10)
    assert not caller.is_alive()  # returned while the step still holds the lock
    assert gate.entered == 4 and engine._steps == 3  # ... and no step ran meanwhile
    load = engine.snapshot()
    assert (load.num_running_reqs, load.num_queue_reqs) == (1, 1)
    assert engine.has_request("new") and engine.has_request("long")
    with pytest.raises(DuplicateRequestId, match="'long' is already in flight"):
        engine.submit([Request(rid="long", parent_rid="long", prompt_ids=[1], params=SamplingParams(),
                               arrival=time.monotonic())])
    gate.permits.release(1000)
    assert joined.wait(60) and done.wait(60)
    assert not engine.has_request("new")  # finished requests leave the rid registry
    assert engine.snapshot().num_queue_reqs == 0


def test_a_submit_wakes_an_idle_loop(gated: tuple[Engine, Gate]) -> None:
    engine, gate = gated
    gate.permits.release(1000)
    for i in range(20):  # an idle loop sleeps on the step lock; every submit must wake it, however timed
        finished = threading.Event()
        engine.submit([Request(rid=f"r{i}", parent_rid=f"r{i}", prompt_ids=[1, 2],
                               params=SamplingParams(max_new_tokens=1), arrival=time.monotonic(),
                               on_finish=lambda _req, e=finished: e.set())])
        assert finished.wait(30), f"request {i} was never run"
