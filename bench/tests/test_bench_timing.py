"""The benchmark timer: interleaved rounds, warm-up, and the minimum timed span."""
import gc
import time
import weakref

import pytest

from bench.harness.timing import MAX_TIMED_ROUNDS, gc_frozen, time_interleaved


def _counting(log: list, name: str, seconds: float = 0.0):
    def call():
        log.append(name)
        if seconds:
            time.sleep(seconds)
    return call


def test_rounds_interleave_and_rotate():
    log: list = []
    timed = time_interleaved({"a": _counting(log, "a"), "b": _counting(log, "b")}, repeats=4, min_warmup_s=0.0)
    assert [len(timed[n].samples_ms) for n in "ab"] == [4, 4]
    # one warm-up round, then the order alternates from round to round
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]


def test_min_timed_s_adds_rounds_until_the_span_is_reached():
    timed = time_interleaved({"f": _counting([], "f", 0.01)}, repeats=2, min_warmup_s=0.0, min_timed_s=0.15)
    samples = timed["f"].samples_ms
    assert len(samples) > 2
    assert sum(samples) >= 150 * 0.9  # sleep granularity aside, the span was honoured
    assert len(samples) <= MAX_TIMED_ROUNDS


def test_min_timed_s_never_cuts_the_requested_repeats():
    timed = time_interleaved({"f": _counting([], "f", 0.01)}, repeats=6, min_warmup_s=0.0, min_timed_s=0.001)
    assert len(timed["f"].samples_ms) == 6


def test_a_failing_function_is_reported_and_dropped():
    def boom():
        raise ValueError("no")

    timed = time_interleaved({"ok": _counting([], "ok"), "bad": boom}, repeats=3, min_warmup_s=0.0)
    assert isinstance(timed["bad"], ValueError)
    assert len(timed["ok"].samples_ms) >= 3


@pytest.mark.parametrize("repeats, number", [(0, 1), (1, 0)])
def test_bad_counts_are_rejected(repeats, number):
    with pytest.raises(ValueError, match="repeats and number"):
        time_interleaved({"f": lambda: None}, repeats=repeats, number=number)


def test_gc_frozen_hides_old_objects_and_still_collects_new_cycles():
    class Node:
        pass

    with gc_frozen():
        assert gc.get_freeze_count() > 0
        node = Node()
        node.self = node  # a cycle: only the collector frees it
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    assert gc.get_freeze_count() == 0
