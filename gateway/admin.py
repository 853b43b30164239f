"""``GET /admin/decisions``: the scheduler's latest decision explanations, a page at a time.

A page is small (``limit`` at most :data:`MAX_PAGE`) and encoded straight to bytes: a whole log
(1,000 records, ~1.5 MB through FastAPI's encoder) once took 0.45 s of the event loop every
streaming request shares. Records are numbered as they are appended, so a cursor (``before``)
stays valid while new decisions arrive and old ones fall off the log.
"""
from __future__ import annotations

import json
from collections import deque
from typing import Any

from starlette.responses import Response

from gateway.errors import RequestError

DEFAULT_PAGE, MAX_PAGE = 20, 100
#: record fields a page can be filtered on (``?tenant=NAME&model=M``): exact matches
FILTERS = ("tenant", "model", "adapter", "priority", "outcome")


class NumberedLog(deque):
    """A bounded deque that counts appends: the record at index ``i`` is number
    ``appended - len(self) + i`` (numbers start at 0 and never repeat)."""

    def __init__(self, items: Any = (), maxlen: int | None = None):
        super().__init__(items, maxlen)
        self.appended = len(self)

    def append(self, item: Any) -> None:
        super().append(item)
        self.appended += 1


def number_decisions(scheduler: Any) -> NumberedLog:
    """Give the scheduler a numbered decision log (same bound, same records)."""
    if not isinstance(scheduler.decisions, NumberedLog):
        scheduler.decisions = NumberedLog(scheduler.decisions, scheduler.decisions.maxlen)
    return scheduler.decisions


def _int(raw: str | None, name: str, default: int, lo: int) -> int:
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = lo - 1
    if v < lo:
        raise RequestError(400, f"invalid parameter {name}: an integer >= {lo}, got {raw[:40]!r}", "invalid_parameter",
                           name)
    return v


def decisions_page(log: NumberedLog, query: Any) -> Response:
    """The newest ``limit`` records older than number ``before`` (default: the newest), oldest
    first, each with its ``seq``; ``next_before`` is the cursor of the page before (null at the
    log's start)."""
    limit = min(_int(query.get("limit"), "limit", DEFAULT_PAGE, 1), MAX_PAGE)
    first = log.appended - len(log)  # number of the oldest record kept
    end = min(_int(query.get("before"), "before", log.appended, 0), log.appended)  # exclusive
    wanted = {k: query.get(k) for k in FILTERS if query.get(k) is not None}
    if wanted:
        return _filtered_page(log, wanted, limit, first, end)
    start = max(first, end - limit)
    page = [{"seq": n, **log[n - first]} for n in range(start, end)] if end > first else []
    body = {"decisions": page, "limit": limit, "total": log.appended,
            "next_before": start if start > first and page else None}
    return Response(json.dumps(body, separators=(",", ":"), default=str).encode(), media_type="application/json")


def _filtered_page(log: NumberedLog, wanted: dict[str, str], limit: int, first: int, end: int) -> Response:
    """The newest ``limit`` matching records older than ``end``; ``next_before`` continues the
    scan below the oldest one returned (null when the log holds no older match)."""
    page: list[dict[str, Any]] = []
    n = end - 1
    while n >= first and len(page) < limit:
        rec = log[n - first]
        if all(str(rec.get(k)) == v for k, v in wanted.items()):
            page.append({"seq": n, **rec})
        n -= 1
    more = n >= first and any(all(str(log[m - first].get(k)) == v for k, v in wanted.items())
                              for m in range(first, n + 1))
    page.reverse()
    body = {"decisions": page, "limit": limit, "total": log.appended, "filters": wanted,
            "next_before": page[0]["seq"] if more and page else None}
    return Response(json.dumps(body, separators=(",", ":"), default=str).encode(), media_type="application/json")
