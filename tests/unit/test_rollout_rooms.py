"""``relax/rollout/`` keeps its shape: the composition at the top, every other module in a room with a docstring.

The direction between the rooms is import-linter's ``rollout-rooms`` contract (``make lint``); this checks what a
contract cannot: that no module is dropped loose into the top folder, and that every room says what it owns.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relax.rollout

ROLLOUT = Path(relax.rollout.__file__).parent
COMPOSITION = {"__init__.py", "settings.py", "assembly.py", "manager.py"}


def test_only_the_composition_lives_directly_in_the_rollout_folder() -> None:
    loose = sorted(p.name for p in ROLLOUT.glob("*.py") if p.name not in COMPOSITION)
    assert loose == [], f"put {loose} into the room of its concept (docs/architecture.md, 'The rollout's rooms')"


def test_every_room_has_a_docstring_saying_what_it_owns_and_may_use() -> None:
    rooms = sorted(p for p in ROLLOUT.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert {p.name for p in rooms} >= {"pool", "routing", "refit", "scaling", "fleet", "dispatch", "control"}
    for room in rooms:
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 30, f"{room.name}/__init__.py needs a paragraph: what it owns, what it uses"
