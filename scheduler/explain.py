"""Decision records: every candidate's terms and why the winner won or the request was refused.

A record is a JSON-ready dict built at decision time. Candidates are a table, not one dict
each: ``record["prefill"] = {"columns": PREFILL_COLUMNS, "rows": [tuple, ...]}`` (and the same
for ``"decode"``). The rows are built the first time anything reads the table (a
:class:`LazyTable`, from columns taken at decision time): a decision keeps a tuple per column
instead of one per candidate, which the garbage collector would walk once each (at 64P+64D,
one collection every ~30 decisions spent ~0.6 ms on them, the decision p99).
``candidates(record, "prefill")`` gives them back as dicts; ``format_lines`` renders the record
the Dynamo way, one line per candidate with every term.
"""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate, Terms

if TYPE_CHECKING:
    from scheduler.stages import Choice

#: A prefill candidate served the way the policy evaluated it. ``ttft_s`` is transfer + queue +
#: prefill, before the prefill->decode shipment (added once the decode instance is known).
PREFILL_COLUMNS = ("id", "role", "hit_tokens", "local_hit_tokens", "transfer_tokens", "transfer_from",
                   "transfer_s", "queue_s", "prefill_s", "ttft_s", "queue_tokens", "queue_requests", "score")
#: A decode candidate with this request added.
DECODE_COLUMNS = ("id", "role", "running", "kv_tokens", "tbt_s", "score")

#: One row of each table, field for field as the columns above.
PrefillRow = tuple[str, str, int, int, int, str | None, float, float, float, float, int, int, float | None]
DecodeRow = tuple[str, str, int, int, float, float | None]


def prefill_row(c: PrefillCandidate, t: Terms, score: float | None) -> PrefillRow:
    return (c.id, c.role, t.hit_tokens, t.local_hit_tokens, t.transfer_tokens, t.transfer_from, t.transfer_s,
            c.queue_s, t.prefill_s, t.transfer_s + c.queue_s + t.prefill_s, c.state.queued_tokens,
            c.state.queued_requests, score)


def decode_row(d: DecodeCandidate, score: float | None) -> DecodeRow:
    return (d.id, d.role, d.state.running, d.state.kv_tokens, d.tbt_s, score)


def table(columns: tuple[str, ...], rows: list[PrefillRow] | list[DecodeRow]) -> dict[str, Any]:
    return {"columns": columns, "rows": rows}


class LazyTable(dict[str, Any]):
    """``{"columns": ..., "rows": [...]}`` whose rows are built from columns the first time the
    table is read: every way of reading a dict (items, values, ``[]``, ``get``, iteration,
    ``dict(t)``, ``{**t}``, ``json.dumps``, ``==``, ``repr``, copy and pickle) sees the built rows.
    A column is one tuple (of numbers: untracked by the garbage collector after its first pass;
    of names: shared by every decision over the same candidates); what the columns refer to
    (the policy's terms per candidate) is never mutated after the decision."""

    __slots__ = ("_make", "_cols")

    def __init__(self, columns: tuple[str, ...], make: Callable[..., list[Any]],
                 cols: tuple[Any, ...]):
        super().__init__(columns=columns, rows=None)
        self._make: Callable[..., list[Any]] | None = make
        self._cols = cols

    def _built(self) -> LazyTable:
        make = self._make
        if make is not None:
            self._make = None
            dict.__setitem__(self, "rows", make(*self._cols))
            self._cols = ()
        return self

    def __getitem__(self, key: str) -> Any:
        return dict.__getitem__(self._built(), key)

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self._built(), key, default)

    def items(self) -> Any:
        return dict.items(self._built())

    def values(self) -> Any:
        return dict.values(self._built())

    def __iter__(self) -> Iterator[str]:  # also keeps dict(t) and {**t} off the raw storage
        return dict.__iter__(self._built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTable):
            other._built()
        return dict.__eq__(self._built(), other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        return dict.__repr__(self._built())

    def __or__(self, other: Any) -> Any:
        return dict(self) | other

    def __ior__(self, other: Any) -> LazyTable:  # type: ignore[override]
        self.update(other)
        return self

    def copy(self) -> dict[str, Any]:
        return dict(self)

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy, deepcopy and pickle: a plain dict
        return dict, (dict(self),)

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self._built(), key, value)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self._built(), key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self._built(), *args, **kwargs)

    def pop(self, *args: Any) -> Any:
        return dict.pop(self._built(), *args)

    def popitem(self) -> tuple[str, Any]:
        return dict.popitem(self._built())

    def setdefault(self, key: str, default: Any = None) -> Any:
        return dict.setdefault(self._built(), key, default)


# the columns' getters, in C (a decision reads 128 candidates' fields through them)
_ID, _ROLE, _LOCAL, _QUEUE_S, _TBT_S = (attrgetter(f) for f in ("id", "role", "local", "queue_s", "tbt_s"))
_QUEUED_TOKENS, _QUEUED_REQUESTS = attrgetter("state.queued_tokens"), attrgetter("state.queued_requests")
_RUNNING, _KV_TOKENS = attrgetter("state.running"), attrgetter("state.kv_tokens")
_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # candidate ids and roles, one tuple per distinct list


def _shared(names: tuple[str, ...]) -> tuple[str, ...]:
    """The same tuple every decision with the same candidates keeps (not a new one to walk)."""
    if len(_names) >= 256:
        _names.clear()
    return _names.setdefault(names, names)


def prefill_table(cands: Sequence[PrefillCandidate], rows: dict[str, Terms], scores: dict[str, float]) -> LazyTable:
    """The prefill candidates' table: each served the way the policy evaluated it (``rows``, else
    the engine-default way), with the policy's score (None where it gave none)."""
    ids = tuple(map(_ID, cands))
    local = tuple(map(_LOCAL, cands))
    terms = tuple(map(rows.get, ids, local)) if rows else local  # few distinct objects, each kept as it is
    return LazyTable(PREFILL_COLUMNS, _prefill_rows,
                     (_shared(ids), _shared(tuple(map(_ROLE, cands))), terms, tuple(map(_QUEUE_S, cands)),
                      tuple(map(_QUEUED_TOKENS, cands)), tuple(map(_QUEUED_REQUESTS, cands)),
                      tuple(map(scores.get, ids))))


def _prefill_rows(ids: Iterable[str], roles: Iterable[str], terms: Iterable[Terms], queue_s: Iterable[float],
                  queued_tokens: Iterable[int], queued_requests: Iterable[int],
                  scores: Iterable[float | None]) -> list[PrefillRow]:
    return [(i, r, t.hit_tokens, t.local_hit_tokens, t.transfer_tokens, t.transfer_from, t.transfer_s, q,
             t.prefill_s, t.transfer_s + q + t.prefill_s, qt, qr, s)
            for i, r, t, q, qt, qr, s in zip(ids, roles, terms, queue_s, queued_tokens, queued_requests, scores,
                                             strict=True)]


def decode_table(cands: Sequence[DecodeCandidate], scores: dict[str, float]) -> LazyTable:
    """The decode candidates' table: each with this request added, and the policy's score."""
    ids = tuple(map(_ID, cands))
    return LazyTable(DECODE_COLUMNS, _decode_rows,
                     (_shared(ids), _shared(tuple(map(_ROLE, cands))), tuple(map(_RUNNING, cands)),
                      tuple(map(_KV_TOKENS, cands)), tuple(map(_TBT_S, cands)), tuple(map(scores.get, ids))))


def _decode_rows(*cols: Iterable[Any]) -> list[DecodeRow]:
    return list(zip(*cols, strict=True))


def deferred_tables(prefill: Sequence[PrefillCandidate], rows: dict[str, Terms], prefill_scores: dict[str, float],
                    decode: Sequence[DecodeCandidate], decode_scores: dict[str, float]) -> tuple[LazyTable, LazyTable]:
    """The same two tables, with not even their columns taken until something reads them: for a
    record ``evaluate`` hands out and its caller drops (the wait room reads one figure of it,
    :func:`cheapest_prefill_s`), never kept in the decision log; the candidates and the policy's
    rows and scores are not mutated after the decision, so a later read builds the same rows."""
    return (LazyTable(PREFILL_COLUMNS, _prefill_rows_of, (prefill, rows, prefill_scores)),
            LazyTable(DECODE_COLUMNS, _decode_rows_of, (decode, decode_scores)))


def _prefill_rows_of(cands: Sequence[PrefillCandidate], rows: dict[str, Terms],
                     scores: dict[str, float]) -> list[PrefillRow]:
    return [prefill_row(c, rows.get(c.id, c.local) if rows else c.local, scores.get(c.id)) for c in cands]


def _decode_rows_of(cands: Sequence[DecodeCandidate], scores: dict[str, float]) -> list[DecodeRow]:
    return [decode_row(d, scores.get(d.id)) for d in cands]


def candidates(record: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """The ``side`` ("prefill" or "decode") candidates of a record, one dict each."""
    t = record.get(side) or {}
    cols = t.get("columns", ())
    return [dict(zip(cols, row, strict=True)) for row in t.get("rows", ())]


def cheapest_prefill_s(record: dict[str, Any]) -> float:
    """The least transfer + prefill over a record's prefill candidates (0.0 with none), read from
    the terms a :class:`LazyTable` still holds rather than building its rows (the wait room asks
    this of every evaluation it makes and keeps nothing else of the record)."""
    t = record.get("prefill")
    if isinstance(t, LazyTable) and t._make is _prefill_rows:
        terms: Iterable[Terms] = t._cols[2]
        return min((x.transfer_s + x.prefill_s for x in terms), default=0.0)
    if isinstance(t, LazyTable) and t._make is _prefill_rows_of:
        cands, rows, _ = t._cols
        if rows:
            return min((x.transfer_s + x.prefill_s for x in map(rows.get, (c.id for c in cands),
                                                                 (c.local for c in cands))), default=0.0)
        return min((c.local.transfer_s + c.local.prefill_s for c in cands), default=0.0)
    return min((r["transfer_s"] + r["prefill_s"] for r in candidates(record, "prefill")), default=0.0)


def request_labels(facts: Any, admit_fraction: float | None = None) -> dict[str, Any]:
    """Who asked and for what (tenant = the API key's name, model, LoRA adapter, priority class),
    the fields ``/admin/decisions`` filters on; only those the request has."""
    out = {k: v for k in ("tenant", "model", "adapter", "priority") if (v := getattr(facts, k, None)) is not None}
    if admit_fraction is not None and admit_fraction != 1.0:
        out["admit_fraction"] = admit_fraction
    return out


def bare_record(request_id: Any, policy: str, now: float, reason: str, message: str) -> dict[str, Any]:
    """A refusal before any candidate was weighed (bad request, nothing healthy)."""
    return {"request_id": request_id, "policy": policy, "time_s": now, "outcome": "rejected",
            "reason": reason, "message": message, "prefill": table(PREFILL_COLUMNS, []),
            "decode": table(DECODE_COLUMNS, [])}


def decision_record(ctx: DecisionContext, ch: Choice, policy: str, score: str, admission: bool,
                    early_rejection: bool, commit: bool = True) -> dict[str, Any]:
    """A weighed decision's record: both tables, the chosen pair's terms, why, and any verdicts."""
    pc, d, terms, slo, violations = ch.prefill, ch.decode, ch.prefill.terms, ch.slo, ch.violations
    rows = pc.rows or {}
    scores = pc.scores
    # an evaluation's record is read once, if at all (the wait room): its tables wait until then
    tables = (prefill_table(ctx.prefill, rows, scores), decode_table(ctx.decode, ch.decode_scores)) if commit \
        else deferred_tables(ctx.prefill, rows, scores, ctx.decode, ch.decode_scores)
    replication = None
    if terms.transfer_from is not None and terms.transfer_tokens > 0:
        replication = {"source": terms.transfer_from, "destination": pc.candidate.id,
                       "tokens": terms.transfer_tokens,
                       "blocks": [pc.candidate.local_blocks, terms.hit_tokens // ctx.block_size]}
    return {
        "request_id": ctx.facts.request_id, "policy": policy, "score": score,
        "time_s": ctx.now, "outcome": "rejected" if violations and admission else "placed",
        "admission": admission,
        "prompt_tokens": ctx.facts.prompt_tokens, "max_tokens": ctx.facts.max_tokens,
        "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "early_rejection": early_rejection,
        **request_labels(ctx.facts, ctx.admit_fraction),
        "store_hit_tokens": ctx.store_blocks * ctx.block_size,
        "best_holder": {"id": ctx.holder, "hit_tokens": ctx.holder_blocks * ctx.block_size},
        "prefill": tables[0],
        "decode": tables[1],
        "chosen": {"prefill": pc.candidate.id, "decode": d.id},
        "terms": {"hit_tokens": terms.hit_tokens, "local_hit_tokens": terms.local_hit_tokens,
                  "transfer_tokens": terms.transfer_tokens, "transfer_from": terms.transfer_from,
                  "transfer_s": terms.transfer_s, "queue_s": pc.candidate.queue_s, "prefill_s": terms.prefill_s,
                  "decode_wait_s": ch.decode_wait_s, "kv_transfer_s": ch.kv_s,
                  "decode_first_step_s": ch.first_step_s, "ttft_s": ch.ttft,
                  "tbt_s": d.tbt_s},
        "why": {"prefill": pc.why, "decode": ch.decode_why, **({"extra": pc.extra} if pc.extra else {})},
        "replication": replication,
        "reason": violations[0].reason if violations else None,
        "violations": [{"reason": v.reason, "message": v.message, "retry_after_s": v.retry_after_s}
                       for v in violations],
        **({"overload": ch.overload} if ch.overload is not None else {}),
    }


def format_lines(record: dict[str, Any]) -> list[str]:
    """One line per candidate with every term, then the verdict (for logs and the admin view)."""
    lines = [f"request {record.get('request_id')} policy={record.get('policy')} "
             f"prompt={record.get('prompt_tokens')} max_tokens={record.get('max_tokens')} "
             f"store_hit={record.get('store_hit_tokens', 0)}"]
    chosen = record.get("chosen") or {}
    for r in candidates(record, "prefill"):
        mark = "*" if r["id"] == chosen.get("prefill") else " "
        src = f" from {r['transfer_from']}" if r.get("transfer_from") else ""
        lines.append(
            f"{mark} prefill {r['id']}: hit={r['hit_tokens']} (local {r['local_hit_tokens']}, "
            f"pulled {r['transfer_tokens']}{src}) transfer={r['transfer_s'] * 1e3:.2f}ms "
            f"queue={r['queue_s'] * 1e3:.2f}ms ({r['queue_requests']} req, {r['queue_tokens']} tok) "
            f"prefill={r['prefill_s'] * 1e3:.2f}ms ttft={r['ttft_s'] * 1e3:.2f}ms score={_num(r['score'])}")
    for r in candidates(record, "decode"):
        mark = "*" if r["id"] == chosen.get("decode") else " "
        lines.append(f"{mark} decode {r['id']}: running={r['running']} kv={r['kv_tokens']} "
                     f"tbt={r['tbt_s'] * 1e3:.2f}ms score={_num(r['score'])}")
    why = record.get("why") or {}
    if record.get("outcome") == "placed":
        terms = record.get("terms") or {}
        lines.append(f"placed on {chosen.get('prefill')} -> {chosen.get('decode')} "
                     f"(ttft={terms.get('ttft_s', 0) * 1e3:.2f}ms incl. kv shipment "
                     f"{terms.get('kv_transfer_s', 0) * 1e3:.2f}ms and first decode step "
                     f"{terms.get('decode_first_step_s', 0) * 1e3:.2f}ms, tbt={terms.get('tbt_s', 0) * 1e3:.2f}ms): "
                     f"prefill: {why.get('prefill', '')}; decode: {why.get('decode', '')}")
    else:
        lines.append(f"rejected ({record.get('reason')}): {record.get('message', '')}")
    return lines


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"
