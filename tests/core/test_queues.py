"""Waiting queues: FCFS and priority behind one interface."""

from __future__ import annotations

import pytest

from tests.core.harness import make_request
from tokenweir.core.sched.queues import FCFSQueue, PriorityQueue, make_queue


def _ids(q):
    return [r.request_id for r in q]


def test_make_queue():
    assert isinstance(make_queue("fcfs"), FCFSQueue)
    assert isinstance(make_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError):
        make_queue("lifo")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_empty_queue(policy):
    q = make_queue(policy)
    assert len(q) == 0 and not q and list(q) == []
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError):
        q.remove(make_request("x", 1, 1))


def test_fcfs_order_prepend_remove():
    q = FCFSQueue()
    r = {i: make_request(f"r{i}", 1, 1, arrival=10 - i, priority=-i) for i in range(5)}
    for i in range(4):
        q.add(r[i])
    assert _ids(q) == ["r0", "r1", "r2", "r3"] and len(q) == 4 and q
    assert q.peek() is r[0]
    assert q.pop() is r[0]
    q.prepend(r[4])  # preempted: ahead of everything waiting, arrival and priority ignored
    assert _ids(q) == ["r4", "r1", "r2", "r3"]
    q.prepend(r[0])
    assert _ids(q) == ["r0", "r4", "r1", "r2", "r3"]
    q.remove(r[1])
    assert _ids(q) == ["r0", "r4", "r2", "r3"]
    with pytest.raises(ValueError):
        q.remove(r[1])
    assert [q.pop().request_id for _ in range(4)] == ["r0", "r4", "r2", "r3"]
    assert not q


def test_fcfs_remove_is_by_identity():
    q = FCFSQueue()
    a, a_twin = make_request("a", 1, 1), make_request("a", 1, 1)
    q.add(a)
    with pytest.raises(ValueError):
        q.remove(a_twin)
    q.remove(a)
    assert len(q) == 0


def test_priority_order_value_then_arrival_then_insertion():
    q = PriorityQueue()
    reqs = [make_request("late-p0", 1, 1, arrival=5, priority=0),
            make_request("p2", 1, 1, arrival=0, priority=2),
            make_request("early-p0", 1, 1, arrival=1, priority=0),
            make_request("neg", 1, 1, arrival=9, priority=-1),
            make_request("tie-a", 1, 1, arrival=3, priority=1),
            make_request("tie-b", 1, 1, arrival=3, priority=1)]
    for r in reqs:
        q.add(r)
    order = ["neg", "early-p0", "late-p0", "tie-a", "tie-b", "p2"]
    assert _ids(q) == order  # iteration is admission order and does not consume
    assert len(q) == 6 and q.peek().request_id == "neg"
    assert [q.pop().request_id for _ in range(6)] == order


def test_priority_prepend_puts_preempted_ahead_of_later_arrivals_of_its_priority():
    q = PriorityQueue()
    preempted = make_request("preempted", 1, 1, arrival=2, priority=1)
    later = make_request("later", 1, 1, arrival=7, priority=1)
    urgent = make_request("urgent", 1, 1, arrival=8, priority=0)
    lazy = make_request("lazy", 1, 1, arrival=0, priority=3)
    for r in (later, urgent, lazy):
        q.add(r)
    q.prepend(preempted)
    assert _ids(q) == ["urgent", "preempted", "later", "lazy"]


def test_priority_remove_keeps_heap_order():
    q = PriorityQueue()
    reqs = [make_request(f"r{i}", 1, 1, arrival=i, priority=(i * 7) % 5) for i in range(12)]
    for r in reqs:
        q.add(r)
    expected = sorted(reqs, key=lambda r: (r.priority, r.arrival_time))
    for victim in (reqs[11], reqs[5], reqs[3], reqs[0]):  # reqs[0] is the head
        q.remove(victim)
        expected.remove(victim)
        assert _ids(q) == [r.request_id for r in expected]
        assert q.peek() is expected[0]
    with pytest.raises(ValueError):
        q.remove(reqs[0])
    assert [q.pop() for _ in range(len(expected))] == expected
