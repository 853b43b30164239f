"""A one-line progress bar with live SLO attainment, redrawn in place on a terminal and printed
every few seconds otherwise (so logs of CI runs stay readable)."""
from __future__ import annotations

import asyncio
import shutil
import sys
from typing import TextIO

from predictors.telemetry import SLO, RequestRecord

from .metrics import percentile


class Progress:
    def __init__(self, total: int, label: str, slo: SLO, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.label, self.slo = total, label, slo
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.sent = self.done = self.ok = self.met = self.rejected = self.failed = 0
        self.lags: list[float] = []

    def on_sent(self, lag_s: float) -> None:
        self.sent += 1
        self.lags.append(lag_s)

    def on_done(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.status == "ok":
            self.ok += 1
            self.met += rec.meets(self.slo)
        elif rec.status == "rejected":
            self.rejected += 1
        else:
            self.failed += 1

    def line(self) -> str:
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        att = f"{100 * self.met / self.done:5.1f}%" if self.done else "   -  "
        lag = percentile(self.lags[-2000:], 99)
        lag_s = f"{lag * 1000:.1f} ms" if lag is not None else "-"
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
                f"{self.sent - self.done} in flight | ok {self.ok} rej {self.rejected} err {self.failed} | "
                f"attainment {att} | send lag p99 {lag_s}")

    async def run(self, stop: asyncio.Event) -> None:
        """Redraw until ``stop`` is set (every 0.5 s on a terminal, every 10 s otherwise)."""
        if not self.enabled:
            await stop.wait()
            return
        period = 0.5 if self.tty else 10.0
        while True:
            try:
                await asyncio.wait_for(stop.wait(), period)
                break
            except asyncio.TimeoutError:
                self._draw(final=False)
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if self.tty:  # one terminal row, or the redraw cannot erase what wrapped
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write("\r\x1b[K" + self.line()[:width] + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
