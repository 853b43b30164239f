"""Workloads: the requests a run replays, read from Mooncake JSONL or Azure CSV traces.

A :class:`Request` carries what a trace records (arrival, lengths, prefix block ids), nothing
about text: :mod:`loadgen.prompts` turns it into a body. Malformed lines are reported with file
and line; ``strict`` stops at the first, otherwise they are skipped and counted so a run over a
slightly damaged trace still says how much it dropped.
"""
from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeGuard

#: Tokens per ``hash_ids`` block in Mooncake's trace release.
TRACE_BLOCK_TOKENS = 512
#: Largest block id prompt synthesis can encode (8 base-64 digits per block, loadgen.prompts).
MAX_HASH_ID = 64**8 - 1
#: Where the traces bundled with a source checkout live (data/traces/ at the repository root).
#: They ship with the repository, not as package data: an installed wheel has no such folder.
BUNDLED_TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
#: Problems kept verbatim for the report (the rest are only counted).
MAX_PROBLEMS_KEPT = 20


class TraceError(ValueError):
    """An unreadable trace, or a malformed line under ``strict``: one line, ``file:line: why``."""


@dataclass(frozen=True)
class Request:
    """One request to replay: when it arrives, how long its prompt and output are, and which
    512-token prefix blocks its prompt is made of (equal ids = identical blocks)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int | None = None  # source line in the trace (1-based), for messages
    conversation: int | None = None  # synthetic multi-turn only
    turn: int | None = None


@dataclass
class Workload:
    requests: list[Request]
    source: str
    kind: str  # "mooncake" | "azure" | "synthetic"
    block_tokens: int = TRACE_BLOCK_TOKENS
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    def head(self, n: int | None) -> "Workload":
        """The first ``n`` requests (all when ``n`` is None)."""
        if n is None or n >= len(self.requests):
            return self
        return replace(self, requests=self.requests[:n])

    def after(self, k: int) -> "Workload":
        """The requests after the first ``k``, renumbered and re-timed to start at 0 (a held-out
        slice replayed as a run of its own)."""
        if k <= 0:
            return self
        if k >= len(self.requests):
            raise TraceError(f"{self.source}: cannot skip {k} requests: only {len(self.requests)} were read")
        t0 = self.requests[k].arrival_s
        return replace(self, requests=[replace(r, index=i, arrival_s=r.arrival_s - t0)
                                       for i, r in enumerate(self.requests[k:])])

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


class _Problems:
    """Collects malformed-line messages; raises the first under ``strict``."""

    def __init__(self, strict: bool, warn: Callable[[str], None] | None):
        self.strict, self.warn = strict, warn
        self.count = 0
        self.kept: list[str] = []

    def __call__(self, where: str, why: str) -> None:
        msg = f"{where}: {why}"
        if self.strict:
            raise TraceError(msg)
        self.count += 1
        if len(self.kept) < MAX_PROBLEMS_KEPT:
            self.kept.append(msg)
            if self.warn:
                self.warn(f"skipping {msg}")


def _is_int(v) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _lines(path: str, bad: Callable[[str, str], None] | None = None) -> Iterator[tuple[int, str]]:
    """Numbered text lines; a line that is not UTF-8 is reported to ``bad`` (file:line) and
    skipped, so one bad byte costs one line (or stops the run under --strict). A BOM is dropped."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                if bad is None:
                    raise TraceError(f"{path}:{n}: not UTF-8 text ({e.reason} at column {e.start + 1})") from None
                bad(f"{path}:{n}", f"not UTF-8 text ({e.reason} at column {e.start + 1})")


def _parse_mooncake(obj, block_tokens: int) -> tuple[float, int, int, tuple[int, ...]] | str:
    """Fields of one Mooncake record, or why it is malformed."""
    if not isinstance(obj, dict):
        return "expected a JSON object"
    ts, n_in, n_out, ids = (obj.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
    if not _is_num(ts) or ts < 0:
        return f"timestamp must be a number >= 0 (ms), got {ts!r}"
    if not _is_int(n_in) or n_in < 1:
        return f"input_length must be an integer >= 1, got {n_in!r}"
    if not _is_int(n_out) or n_out < 1:
        return f"output_length must be an integer >= 1, got {n_out!r}"
    if not isinstance(ids, list) or not all(_is_int(h) and 0 <= h <= MAX_HASH_ID for h in ids):
        return f"hash_ids must be a list of integers in [0, {MAX_HASH_ID}]"
    want = math.ceil(n_in / block_tokens)
    if len(ids) != want:
        return f"{len(ids)} hash_ids for input_length {n_in} (expected ceil({n_in}/{block_tokens}) = {want})"
    return ts / 1000.0, n_in, n_out, tuple(ids)


def read_mooncake(path: str, *, strict: bool = False, limit: int | None = None,
                  block_tokens: int = TRACE_BLOCK_TOKENS, warn: Callable[[str], None] | None = None) -> Workload:
    """Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` per line."""
    bad = _Problems(strict, warn)
    rows: list[tuple[float, int, int, tuple[int, ...], int]] = []
    for n, line in _lines(path, bad):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad(f"{path}:{n}", f"not JSON ({e.msg} at column {e.colno})")
            continue
        parsed = _parse_mooncake(obj, block_tokens)
        if isinstance(parsed, str):
            bad(f"{path}:{n}", parsed)
            continue
        rows.append((*parsed, n))
    return _workload(rows, path, "mooncake", block_tokens, bad)


def _parse_azure_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits) or plain seconds, as epoch seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    base, _, frac = text.partition(".")
    t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()  # not local time
    if frac:
        if not frac.isdigit():
            raise ValueError(f"bad fractional seconds {frac!r}")
        t += int(frac) / 10 ** len(frac)
    return t


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure(path: str, *, strict: bool = False, limit: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS, warn: Callable[[str], None] | None = None) -> Workload:
    """Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    The trace has no prefix information: every prompt gets fresh block ids (unique prompts).
    A recorded output of 0 tokens is sent as 1 (``max_tokens`` must be >= 1).
    """
    bad = _Problems(strict, warn)
    rows: list[tuple[float, int, int, tuple[int, ...], int]] = []
    header: list[str] | None = None
    next_id = 0
    for n, line in _lines(path, bad):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        cells = next(csv.reader([line]))
        if header is None:
            header = [c.strip() for c in cells]
            if [c.lower() for c in header[:3]] != [c.lower() for c in AZURE_COLUMNS]:
                raise TraceError(f"{path}:{n}: expected header {','.join(AZURE_COLUMNS)}, got {line.strip()[:80]!r}")
            continue
        if len(cells) < 3:
            bad(f"{path}:{n}", f"expected 3 columns, got {len(cells)}")
            continue
        try:
            t = _parse_azure_time(cells[0])
        except ValueError as e:
            bad(f"{path}:{n}", f"bad TIMESTAMP {cells[0]!r} ({e})")
            continue
        try:
            n_in, n_out = int(cells[1]), int(cells[2])
        except ValueError:
            bad(f"{path}:{n}", f"token counts must be integers, got {cells[1]!r}, {cells[2]!r}")
            continue
        if n_in < 1 or n_out < 0:
            bad(f"{path}:{n}", f"need ContextTokens >= 1 and GeneratedTokens >= 0, got {n_in}, {n_out}")
            continue
        k = math.ceil(n_in / block_tokens)
        rows.append((t, n_in, max(1, n_out), tuple(range(next_id, next_id + k)), n))
        next_id += k
    if header is None:
        raise TraceError(f"{path}: empty trace (no header)")
    return _workload(rows, path, "azure", block_tokens, bad)


def _workload(rows, path: str, kind: str, block_tokens: int, bad: _Problems) -> Workload:
    if not rows:
        first = f" ({bad.count} malformed lines; first: {bad.kept[0]})" if bad.kept else ""
        raise TraceError(f"{path}: no usable requests{first}")
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0]
    reqs = [Request(i, t - t0, n_in, n_out, ids, line=ln) for i, (t, n_in, n_out, ids, ln) in enumerate(rows)]
    return Workload(reqs, path, kind, block_tokens, bad.count, bad.kept)


def detect_format(path: str) -> str:
    """``mooncake`` or ``azure`` from the extension, else from the first non-blank line."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        return "mooncake"
    if ext == ".csv":
        return "azure"
    for _, line in _lines(path):
        if line.strip():
            return "mooncake" if line.lstrip().startswith("{") else "azure"
    raise TraceError(f"{path}: empty trace")


def read_trace(path: str, fmt: str = "auto", **kw) -> Workload:
    """Read a trace of either format (``fmt``: auto, mooncake or azure)."""
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "mooncake":
        return read_mooncake(path, **kw)
    if fmt == "azure":
        return read_azure(path, **kw)
    raise TraceError(f"unknown trace format {fmt!r}")


def bundled_trace(name: str) -> Path:
    """The path of a trace bundled in ``data/traces/`` (e.g. ``mooncake_conversation_trace.jsonl``).

    Raises ``FileNotFoundError`` naming the folder when it is missing, as it is outside a source
    checkout (the traces are repository data, not package data)."""
    path = BUNDLED_TRACES / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such bundled trace (data/traces/ exists only in a source checkout)")
    return path
