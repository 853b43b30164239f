"""Decision records: every candidate's terms and why the winner won or the request was refused.

A record is a plain, JSON-ready dict built at decision time. Candidates are a table, not one
dict each: ``record["prefill"] = {"columns": PREFILL_COLUMNS, "rows": [tuple, ...]}`` (and the
same for ``"decode"``), which keeps a decision cheap to build and to keep a thousand of
(tuples of numbers are not walked by the garbage collector). ``candidates(record, "prefill")``
gives them back as dicts; ``format_lines`` renders the record the Dynamo way, one line per
candidate with every term.
"""
from __future__ import annotations

from typing import Any

from scheduler.cost import DecodeCandidate, PrefillCandidate, Terms

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


def candidates(record: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """The ``side`` ("prefill" or "decode") candidates of a record, one dict each."""
    t = record.get(side) or {}
    cols = t.get("columns", ())
    return [dict(zip(cols, row, strict=True)) for row in t.get("rows", ())]


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
