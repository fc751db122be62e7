"""The suite's own scheduling (tests/scheduling.py): the e2e group is one unit, every other file its own."""

from __future__ import annotations

from tests.scheduling import unit_of_work


def test_e2e_files_are_one_unit_and_other_files_one_each() -> None:
    assert unit_of_work("tests/e2e/test_training.py::test_it_learns") == "e2e"
    assert unit_of_work("tests/e2e/test_preemption.py::test_x[a::b]") == "e2e"
    assert unit_of_work("tests/integration/test_elastic.py::test_a") == "tests/integration/test_elastic.py"
    assert unit_of_work("tests/unit/test_pool.py::TestX::test_y[1]") == "tests/unit/test_pool.py"
    assert unit_of_work("tests/unit/test_e2e_names.py::t") == "tests/unit/test_e2e_names.py"
