"""Decision records' candidate tables are built lazily (scheduler/explain.py ``LazyTable``): every
way of reading one gives what building the rows at decision time gave, and an unread table holds
a handful of objects for the garbage collector, not one per candidate."""
import copy
import gc
import json
import pickle

import pytest

from predictors.base import DecodeState, PrefillState
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.cost import DecodeCandidate, PrefillCandidate, Terms
from scheduler.explain import (
    DECODE_COLUMNS,
    PREFILL_COLUMNS,
    LazyTable,
    candidates,
    decode_row,
    decode_table,
    format_lines,
    prefill_row,
    prefill_table,
    table,
)
from scheduler.hashing import block_hashes
from tests.sched_helpers import Clock, toks


def _prefill(n=64):
    shared = Terms(0, 0, 0, None, 0.0, 0.25, 0)
    pulled = Terms(4096, 1024, 3072, "p03", 0.004, 0.1, 16)
    cands = []
    for k in range(n):
        state = PrefillState(f"p{k:02d}", 100 * k, 0.01 * k, k % 3)
        c = PrefillCandidate(f"p{k:02d}", "both" if k % 5 == 0 else "prefill", k % 4, k % 6, state, 0.01 * k, k, k % 2)
        c.local = shared
        cands.append(c)
    rows = {"p01": pulled, "p07": pulled}
    scores = {c.id: 1.0 / (k + 1) for k, c in enumerate(cands) if k != 9}  # one candidate unscored: None
    return cands, rows, scores


def _decode(n=64):
    cands = [DecodeCandidate(f"d{k:02d}", "decode", DecodeState(f"d{k:02d}", k, 1000 * k), 0.01 + k * 1e-4)
             for k in range(n)]
    return cands, {c.id: c.tbt_s * 2 for c in cands}


def _eager():
    cands, rows, scores = _prefill()
    dc, ds = _decode()
    return (table(PREFILL_COLUMNS, [prefill_row(c, rows.get(c.id, c.local), scores.get(c.id)) for c in cands]),
            table(DECODE_COLUMNS, [decode_row(d, ds.get(d.id)) for d in dc]))


def _lazy():
    cands, rows, scores = _prefill()
    dc, ds = _decode()
    return prefill_table(cands, rows, scores), decode_table(dc, ds)


READS = {
    "eq": lambda t: t,
    "json": lambda t: json.dumps(t),
    "json_sorted_nested": lambda t: json.dumps({"x": [t]}, sort_keys=True),
    "dict": lambda t: dict(t),
    "unpack": lambda t: {**t},
    "union": lambda t: t | {"k": 1},
    "runion": lambda t: {"k": 1} | t,
    "items": lambda t: list(t.items()),
    "values": lambda t: list(t.values()),
    "getitem": lambda t: t["rows"],
    "get": lambda t: t.get("rows"),
    "iter": lambda t: [(k, dict.__getitem__(t, k)) for k in t],
    "repr": lambda t: repr(t),
    "copy": lambda t: t.copy(),
    "deepcopy": lambda t: copy.deepcopy(t),
    "pickle": lambda t: pickle.loads(pickle.dumps(t)),
    "candidates": lambda t: candidates({"prefill": t}, "prefill"),
}


@pytest.mark.parametrize("read", list(READS))
def test_every_read_of_a_lazy_table_sees_the_rows_built_at_decision_time(read):
    eager, lazy = _eager(), _lazy()
    for e, lz in zip(eager, lazy, strict=True):
        assert isinstance(lz, LazyTable) and isinstance(lz, dict)
        got = READS[read](lz)  # the first read of this table
        want = READS[read](e)
        assert got == want and repr(got) == repr(want)  # same values and the same types (int, float, None)
        assert lz == e and e == lz and not (lz != e)


def test_lazy_rows_keep_every_column_exact():
    cands, rows, scores = _prefill(3)
    cands[1].queue_s = 2  # an int from a custom queue predictor stays an int
    cands[2].state = PrefillState("p02", 2**70, 0.0, 1)  # beyond int64: kept as it is
    scores = {"p00": 1, "p01": None}
    lazy = prefill_table(cands, rows, scores)
    want = [prefill_row(c, rows.get(c.id, c.local), scores.get(c.id)) for c in cands]
    assert lazy["rows"] == want and repr(lazy["rows"]) == repr(want)
    empty = prefill_table([], {}, {})
    assert empty["rows"] == [] and decode_table([], {})["rows"] == []


def test_writes_to_a_lazy_table_land_on_the_built_rows():
    _, lazy = _lazy()
    lazy["note"] = "x"
    assert len(lazy["rows"]) == 64 and lazy["note"] == "x"
    _, lazy = _lazy()
    lazy.update(extra=1)
    assert len(lazy["rows"]) == 64
    _, lazy = _lazy()
    assert lazy.pop("rows") and "rows" not in lazy
    _, lazy = _lazy()
    lazy |= {"k": 2}
    assert lazy["k"] == 2 and len(lazy["rows"]) == 64


def _tracked_reachable(obj, stop):
    """GC-tracked objects reachable from ``obj``, not walking into ``stop`` objects."""
    seen, todo = set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or id(o) in stop or not gc.is_tracked(o):
            continue
        seen.add(id(o))
        todo.extend(gc.get_referents(o))
    return len(seen)


def test_an_unread_table_holds_a_few_objects_not_one_per_candidate():
    cands, rows, scores = _prefill(64)
    dc, ds = _decode(64)
    shared = {id(c.local) for c in cands} | {id(t) for t in rows.values()} | {id(type(c)) for c in cands}
    shared |= {id(LazyTable), id(type(cands[0].local))}
    for t in (prefill_table(cands, rows, scores), decode_table(dc, ds)):
        t_funcs = {id(t._make)}
        assert _tracked_reachable(t, shared | t_funcs) <= 10  # the table and its columns
        assert len(t["rows"]) == 64  # and the rows are all there once read


def test_a_decision_record_renders_its_candidates():
    clock = Clock(0.0)
    insts = [Instance(f"p{k}", "prefill") for k in range(3)] + [Instance(f"d{k}", "decode") for k in range(2)]
    sched = Scheduler(insts, clock=clock, block_size=16)
    d = sched.decide(RequestFacts("r", 1000, block_hashes(toks(1, 1000), 16), 50))
    assert isinstance(d, Placement) and d.explanation is sched.decisions[-1]
    assert [r["id"] for r in candidates(d.explanation, "prefill")] == ["p0", "p1", "p2"]
    assert [r["id"] for r in candidates(d.explanation, "decode")] == ["d0", "d1"]
    assert json.loads(json.dumps(d.explanation))["prefill"]["rows"][0][0] == "p0"
    assert len(format_lines(d.explanation)) == 1 + 3 + 2 + 1
