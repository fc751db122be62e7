"""``failure_cause``: what an engine failure's log line, event and ``error`` field say, from real Ray errors.

The exceptions are Ray's own classes built in process (no cluster): a ``RayTaskError`` as a remote call's
failure arrives (ANSI-coloured task name, traceback, ``.cause``), its dual ``as_instanceof_cause()`` form,
nested task errors, and ``ActorDiedError`` with no cause, with Ray's death context (the protobuf the GCS
sends) and after a failed constructor.
"""

from __future__ import annotations

import traceback

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError

from relax.logs import failure_cause, strip_ansi

TASK = "\x1b[36mray::EngineActor.start()\x1b[39m"


def task_error(exc: BaseException, function: str = "EngineActor.start") -> RayTaskError:
    """A RayTaskError as Ray builds it in the worker: the traceback of ``exc`` raised there."""
    try:
        raise exc
    except BaseException as raised:
        return RayTaskError(function, traceback.format_exc(), raised, proctitle=TASK.strip(), pid=4321,
                            ip="10.0.0.7", actor_repr="EngineActor(engine_3)", actor_id="ab" * 8)


def died(message: str) -> ActorDiedError:
    context = ActorDiedErrorContext(error_message=message, class_name="EngineActor", actor_id=b"\x01" * 16,
                                    pid=4321, ray_namespace="relax", node_ip_address="10.0.0.7")
    return ActorDiedError(context)


def test_a_task_error_gives_the_innermost_exception_not_the_coloured_task_name() -> None:
    error = task_error(ValueError("weights v3 do not match the manifest"))
    assert str(error).splitlines()[0].startswith("\x1b[36m")  # what the log line showed before
    assert failure_cause(error) == "ValueError: weights v3 do not match the manifest"
    assert failure_cause(error.as_instanceof_cause()) == "ValueError: weights v3 do not match the manifest"


def test_nested_task_errors_are_followed_to_the_first_cause() -> None:
    inner = task_error(RuntimeError("server exited with code 1\nlast log line: CUDA out of memory"))
    outer = task_error(inner.as_instanceof_cause(), function="RolloutManager.start_initial_engines")
    assert failure_cause(outer) == "RuntimeError: server exited with code 1 last log line: CUDA out of memory"


def test_without_its_cause_the_last_line_of_the_traceback_is_used() -> None:
    error = task_error(KeyError("model.embed_tokens.weight"))
    error.cause = None  # a cause Ray could not deserialize
    assert failure_cause(error) == "KeyError: 'model.embed_tokens.weight'"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
         "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some "
         "potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.",
         "ActorDiedError: The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"),
        ("The actor died because its node has died. Node Id: 5f1c\n\tthe actor's node was terminated "
         "unexpectedly: received SIGTERM", "ActorDiedError: The actor died because its node has died. Node Id: "
         "5f1c the actor's node was terminated unexpectedly: received SIGTERM"),
        ("The actor is dead because it was killed by `ray.kill`.",
         "ActorDiedError: The actor is dead because it was killed by `ray.kill`."),
    ],
)
def test_a_dead_actor_gives_rays_death_cause(message: str, expected: str) -> None:
    error = died(message)
    assert str(error).splitlines()[0] == "The actor died unexpectedly before finishing this task."
    cause = failure_cause(error)
    assert cause.startswith(expected) and "pid:" not in cause and "10.0.0.7" not in cause
    if "SIGKILL" in message:
        assert "SIGKILL" in cause


def test_a_dead_actor_without_a_cause_says_so() -> None:
    assert failure_cause(ActorDiedError()) == (
        "ActorDiedError: The actor died unexpectedly before finishing this task. (Ray gave no cause)")


def test_an_actor_whose_constructor_raised_gives_that_error() -> None:
    error = ActorDiedError(task_error(OSError("no GPU visible"), function="EngineActor.__init__"))
    assert failure_cause(error) == "ActorDiedError: its constructor raised OSError: no GPU visible"


def test_other_exceptions_are_type_and_message_in_one_short_line_without_ansi() -> None:
    assert failure_cause(RuntimeError("\x1b[31mserver exited\x1b[0m\n  with code 1")) == (
        "RuntimeError: server exited with code 1")
    assert failure_cause(TimeoutError()) == "TimeoutError"
    long = failure_cause(RuntimeError("x" * 1000), limit=40)
    assert len(long) == 40 and long.endswith("...")
    assert strip_ansi(f"{TASK} (pid=1)\x1b]0;title\x07\x1b[1;31mred\x1b[K") == "ray::EngineActor.start() (pid=1)red"
