"""The synthetic task of the tiny preset: single-digit addition answered as ``Answer: N``.

Why this task: a ~100 k-parameter model learns the 100 facts of the addition table in seconds
on one CPU thread, responses are four or five tokens, and the reward is exact and cheap. That
makes it the smallest task on which GRPO *visibly* learns within a few CPU minutes, which is what
the learning test and ``make demo`` need.

Everything here is pure and seeded: the same seed gives the same problems and splits, which is
part of what keeps the preset byte-identical between builds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The answer line the policy is taught to write; the reward parses the same prefix (as DAPO does).
ANSWER_PREFIX = "Answer:"
#: Operands are single digits, so answers are 0..18.
MAX_OPERAND = 9
ANSWER_RANGE = range(0, 2 * MAX_OPERAND + 1)

#: Several phrasings per fact. Eval holds out whole (fact, phrasing) prompts, so eval prompts never
#: appear in train while every fact is still taught in train under other phrasings.
TEMPLATES: tuple[str, ...] = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "{a} + {b} = ?",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
    "Calculate {a} plus {b}.",
    "How much is {a} + {b}?",
    "Find {a} + {b}.",
)


@dataclass(frozen=True)
class Problem:
    """One prompt of the task: its text and the correct integer answer."""

    text: str
    answer: int


def all_problems() -> list[Problem]:
    """Every distinct prompt of the task (100 facts x len(TEMPLATES) phrasings), in a fixed order."""
    return [
        Problem(template.format(a=a, b=b), a + b)
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
        for template in TEMPLATES
    ]


def split_problems(seed: int, n_eval: int = 200) -> tuple[list[Problem], list[Problem]]:
    """Split the distinct prompts into disjoint (train, eval) sets.

    Held-out prompts are chosen so that each fact keeps at least one phrasing in train: eval then
    measures the skill the policy is trained on, not memorisation of unseen facts.
    """
    rng = random.Random(f"split-{seed}")
    problems = all_problems()
    per_fact = len(TEMPLATES)
    facts = [problems[i : i + per_fact] for i in range(0, len(problems), per_fact)]
    n_eval_per_fact, extra = divmod(n_eval, len(facts))
    if n_eval_per_fact + (1 if extra else 0) >= per_fact:
        raise ValueError(f"n_eval={n_eval} leaves some fact without a train phrasing")
    extra_facts = set(rng.sample(range(len(facts)), extra))
    train: list[Problem] = []
    eval_: list[Problem] = []
    for i, phrasings in enumerate(facts):
        shuffled = list(phrasings)
        rng.shuffle(shuffled)
        k = n_eval_per_fact + (1 if i in extra_facts else 0)
        eval_.extend(shuffled[:k])
        train.extend(shuffled[k:])
    rng.shuffle(eval_)
    return train, eval_


def sample_train_lines(train: Sequence[Problem], n_lines: int, seed: int) -> list[Problem]:
    """A shuffled train list of ``n_lines`` prompts: whole passes over ``train``, each reshuffled.

    Repeating prompts across epochs is how an RL prompt set is normally consumed; writing them out
    keeps the data loader simple (one line = one prompt) and the file the shape of dapo-math.
    """
    rng = random.Random(f"train-lines-{seed}")
    out: list[Problem] = []
    while len(out) < n_lines:
        epoch = list(train)
        rng.shuffle(epoch)
        out.extend(epoch)
    return out[:n_lines]


def format_answer(value: int) -> str:
    """The exact response text the warm start teaches (the eos token is appended by the tokenizer side)."""
    return f"{ANSWER_PREFIX} {value}"


def to_record(problem: Problem) -> dict:
    """A dapo-math style JSONL record: chat-format prompt plus the label as a string."""
    return {"prompt": [{"role": "user", "content": problem.text}], "label": str(problem.answer)}


def write_jsonl(path: Path, problems: Iterable[Problem]) -> int:
    """Write one record per line (stable key order, ASCII) and return the number of lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for problem in problems:
            f.write(json.dumps(to_record(problem), ensure_ascii=True) + "\n")
            n += 1
    return n
