"""tests/suite_order.py: a module is one unit of work (split when it took long), units go
heaviest first by the recorded durations, and the durations file is read defensively."""

from __future__ import annotations

import suite_order as so


def test_a_module_is_one_unit_and_a_long_module_is_split_the_same_way_in_any_order():
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3", "tests/b.py::t1"]
    assert so.assign_units(ids, {}) == {"tests/a.py::t1": "tests/a.py",
                                        "tests/a.py::t2": "tests/a.py",
                                        "tests/a.py::t3": "tests/a.py",
                                        "tests/b.py::t1": "tests/b.py"}
    long = {"tests/a.py::t1": so.MAX_GROUP_S, "tests/a.py::t2": 1.0}
    split = so.assign_units(ids, long)
    assert [split[i] for i in ids] == ["tests/a.py#0", "tests/a.py#1", "tests/a.py#0",
                                       "tests/b.py"]
    assert so.assign_units(ids[::-1], long) == split  # --random-order: the same split


def test_heaviest_units_first_and_the_rest_keep_their_order():
    ids = ["tests/a.py::fast", "tests/b.py::t1", "tests/c.py::slow", "tests/d.py::new",
           "tests/b.py::t2", "tests/e.py::mid"]
    durations = {"tests/a.py::fast": 0.5, "tests/b.py::t1": 20.0, "tests/b.py::t2": 30.0,
                 "tests/c.py::slow": 60.0, "tests/e.py::mid": 9.0}
    queue = so.slowest_first(ids, durations)
    # b (50 s together) and c (60 s) share the weight class 2**5; then e (2**3); then the rest
    assert list(queue) == ["tests/b.py", "tests/c.py", "tests/e.py", "tests/a.py", "tests/d.py"]
    assert queue["tests/b.py"] == {"tests/b.py::t1": False, "tests/b.py::t2": False}
    assert sorted(i for unit in queue.values() for i in unit) == sorted(ids)


def test_a_damaged_durations_file_orders_nothing(tmp_path):
    path = tmp_path / so.DURATIONS_FILE
    assert so.read_durations(path) == {}
    path.write_text("[1, 2]")
    assert so.read_durations(path) == {}
    path.write_text('{"t": 3, "u": "x"}')
    assert so.read_durations(path) == {"t": 3.0}
