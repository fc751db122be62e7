"""Reward functions (DAPO rule, math-verify, DeepScaleR-style) and the registry."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import pytest

from relax.data.rewards import RewardConfigError, available_reward_types, dapo, get_reward_fn, load_callable
from relax.data.rewards.math_verify_reward import compute_deepscaler_score, compute_score, last_boxed_content

# ---- DAPO ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Let me think.\nAnswer: 34", "34", 1.0),
        ("answer : 34\n", "34", 1.0),  # case-insensitive, spaces around the colon
        ("Answer: 12\nwait, no.\nAnswer: 34", "34", 1.0),  # the last Answer: line counts
        ("Answer: 34\nActually Answer: 35", "34", -1.0),
        ("The result is 34.", "34", -1.0),  # no Answer: line
        ("Answer: $\\boxed{34}$", "34", 1.0),
        ("Answer: 1,000", "1000", 1.0),  # thousands separator
        ("Answer: 30 degrees", "30", 1.0),  # unit removed
        ("Answer: x = 5", "5", 1.0),  # text after the last '='
        ("Answer: \\text{(B)}", "(B)", 1.0),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # shorthand expanded
        ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # string rule, not symbolic
        ("Answer: 35", "34", -1.0),
        ("Answer: 34" + "x" * 400, "34", -1.0),  # only the last 300 characters are read
    ],
)
def test_dapo_rule(response: str, label: str, expected: float) -> None:
    assert dapo.compute_score(response, label) == expected


def test_dapo_helpers() -> None:
    assert dapo.extract_answer("a\nAnswer: 7 apples\nmore") == "7 apples"
    assert dapo.extract_answer("nothing") is None
    assert dapo.normalize_final_answer("  $12$ ") == "12"
    assert dapo.normalize_final_answer("\\boxed{\\sqrt2}") == "\\sqrt{2}"


# ---- math-verify -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("so the answer is \\boxed{34}.", "34", 1.0),
        ("the answer is $\\boxed{\\frac{3}{4}}$", "0.75", 1.0),  # symbolic, not string, equality
        ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),  # bare-LaTeX label
        ("\\boxed{35}", "34", 0.0),
        ("no answer here", "34", 0.0),
        ("\\boxed{34}", "", 0.0),
    ],
)
def test_math_verify_reward(response: str, label: str, expected: float) -> None:
    assert compute_score(response, label) == expected


def test_math_verify_works_off_the_main_thread() -> None:
    """signal.alarm-based timeouts would raise here; the reward must not rely on them."""
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(compute_score("\\boxed{2}", "2")))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_math_verify_exceptions_count_as_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("parser crashed")

    monkeypatch.setattr(math_verify, "parse", boom)
    assert compute_score("\\boxed{2}", "2") == 0.0
    assert compute_deepscaler_score("\\boxed{3}", "2") == 0.0


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("<think>maybe \\boxed{3}</think> final: \\boxed{2}", "2", 1.0),
        ("<think>\\boxed{2}</think> I give up", "2", 0.0),  # box only inside the thinking
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is 2", "2", 0.0),  # no box
        ("\\boxed{2", "2", 0.0),  # cut off inside the box
    ],
)
def test_deepscaler_reward(response: str, label: str, expected: float) -> None:
    assert compute_deepscaler_score(response, label) == expected


def test_last_boxed_content() -> None:
    assert last_boxed_content("\\boxed{1} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed_content("\\fbox{7}") == "7"
    assert last_boxed_content("none") is None


# ---- registry --------------------------------------------------------------------------------------


def test_builtin_types() -> None:
    assert available_reward_types() == ["dapo", "deepscaler", "last-number", "math", "tiny"]
    assert get_reward_fn("dapo") is dapo.compute_score
    assert get_reward_fn("math") is compute_score
    assert get_reward_fn("deepscaler") is compute_deepscaler_score


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("7 + 7 = 14", "14", 1.0),
        ("The answer is 17.", "17", 1.0),
        ("The sum of 7 and 1 is 7.", "8", 0.0),
        ("14, or maybe 15", "14", 0.0),  # the last number is the claim: listing candidates does not pay
        ("8 + 6 = 14\n\nIn mathematics, 2 + 2", "14", 0.0),  # rambling past the answer ends on another number
        ("-3", "-3", 1.0),
        ("12.0", "12", 1.0),
        ("no number here", "3", 0.0),
        ("", "3", 0.0),
        ("5", "five", 0.0),  # an unparsable label scores 0, never raises
    ],
)
def test_last_number_rule(response: str, label: str, expected: float) -> None:
    assert get_reward_fn("last-number")(response, label) == expected


def test_last_number_never_raises_on_non_strings() -> None:
    from relax.data.rewards.last_number import compute_score as last_number_score

    assert last_number_score(None, "3") == 0.0  # type: ignore[arg-type]


def test_tiny_resolves_to_the_task_reward() -> None:
    tiny_task = pytest.importorskip("relax.data.rewards.tiny_task")
    assert get_reward_fn("tiny") is tiny_task.compute_score


def test_tiny_is_imported_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("relax.data.rewards.tiny_task")
    fake.compute_score = lambda response, label: 1.0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "relax.data.rewards.tiny_task", fake)
    assert get_reward_fn("tiny")("Answer: 3", "3") == 1.0


@pytest.fixture
def custom_module(monkeypatch: pytest.MonkeyPatch) -> str:
    mod = types.ModuleType("my_rewards")
    mod.exact = lambda response, label: response == label  # type: ignore[attr-defined]
    mod.bad_type = lambda response, label: "yes"  # type: ignore[attr-defined]
    mod.NOT_CALLABLE = 3  # type: ignore[attr-defined]
    mod.parts = lambda response, label: {"score": 0.75, "acc": response == label}  # type: ignore[attr-defined]

    class Scorer:
        @staticmethod
        def score(response: str, label: str) -> float:
            return 0.5

    mod.Scorer = Scorer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_rewards", mod)
    return "my_rewards"


def test_custom_by_dotted_path(custom_module: str) -> None:
    for path in ("my_rewards:exact", "my_rewards.exact"):
        fn = get_reward_fn(None, path)
        assert fn("a", "a") == 1.0 and fn("a", "b") == 0.0  # bool coerced to float
    assert get_reward_fn("dapo", "my_rewards:exact")("a", "a") == 1.0  # custom path wins
    assert get_reward_fn("my_rewards:Scorer.score")("a", "b") == 0.5  # rm_type may be a path
    with pytest.raises(TypeError, match="returned str"):
        get_reward_fn(None, "my_rewards:bad_type")("a", "b")


def test_a_dict_result_is_read_at_the_reward_key(custom_module: str) -> None:
    assert get_reward_fn(None, "my_rewards:parts", reward_key="score")("a", "b") == 0.75
    assert get_reward_fn("my_rewards:parts", reward_key="acc")("a", "a") == 1.0
    with pytest.raises(TypeError, match=r"returned a dict \(keys \['acc', 'score'\]\); name the entry"):
        get_reward_fn(None, "my_rewards:parts")("a", "b")
    with pytest.raises(TypeError, match="without --reward-key 'reward'"):
        get_reward_fn(None, "my_rewards:parts", reward_key="reward")("a", "b")
    assert get_reward_fn(None, "my_rewards:exact", reward_key="score")("a", "a") == 1.0  # a number is the reward


@pytest.mark.parametrize(
    ("rm_type", "path", "pattern"),
    [
        ("nope", None, "unknown reward type 'nope'; choose one of"),
        (None, None, "no reward chosen"),
        (None, "no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        (None, "my_rewards:missing", "has no attribute 'missing'"),
        (None, "my_rewards:NOT_CALLABLE", "is a int, not a callable"),
        (None, "justaname", "must look like"),
        (None, "mod:", "must look like"),
    ],
)
def test_registry_errors(custom_module: str, rm_type: str | None, path: str | None, pattern: str) -> None:
    with pytest.raises(RewardConfigError, match=pattern):
        get_reward_fn(rm_type, path)


def test_import_time_error_is_wrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pkg = tmp_path / "broken_reward_mod.py"
    pkg.write_text("raise RuntimeError('half-installed dependency')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardConfigError, match="RuntimeError: half-installed dependency"):
        load_callable("broken_reward_mod:f")
