"""``argmin_scored`` (the lowest score found in C, tie-breakers only among equals) picks exactly
what ``argmin`` over (score, tie-breakers) tuples picks, random tie-breaking included."""
import random

from hypothesis import given, settings, strategies as st

from scheduler.policies.base import argmin, argmin_scored, runner_up

scores = st.sampled_from([0.0, -0.0, 1.0, 1.5, 2.0, 1e-9, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(scores, st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=12),
       st.integers(0, 2**32), st.booleans())
def test_argmin_scored_picks_what_argmin_over_tuples_picks(rows, seed, with_rng):
    items = [(k, s, a, b) for k, (s, a, b) in enumerate(rows)]  # distinct items (k) carrying their keys
    want = argmin(items, key=lambda x: (x[1], (x[2], x[3])), rng=random.Random(seed) if with_rng else None)
    got = argmin_scored(items, [x[1] for x in items], lambda x: (x[2], x[3]),
                        random.Random(seed) if with_rng else None)
    assert got is want


def test_ties_on_the_score_go_to_the_tie_breaker_then_the_draw():
    items = ["a", "b", "c", "d"]
    tie = {"a": 3, "b": 1, "c": 1, "d": 0}.__getitem__
    assert argmin_scored(items, [2.0, 1.0, 1.0, 3.0], tie) == "b"  # first of the equal best
    picks = {argmin_scored(items, [2.0, 1.0, 1.0, 3.0], tie, random.Random(s)) for s in range(40)}
    assert picks == {"b", "c"}
    assert argmin_scored(items, [5.0, 4.0, 0.5, 3.0], tie) == "c"


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), scores, max_size=5),
       st.sampled_from(["a", "b", "z"]))
def test_runner_up_is_the_lowest_score_and_id_but_the_winners(by_id, winner):
    others = [(v, k) for k, v in by_id.items() if k != winner]
    want = "" if not others else " (next {} {:.4g})".format(*reversed(min(others)))
    assert runner_up(by_id, winner) == want
