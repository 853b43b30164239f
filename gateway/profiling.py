"""Opt-in profile of the gateway's own CPU (bench/gateway_cpu.py). With ``CONDUCTOR_PROFILE=PATH``
in its environment, ``conductor serve`` profiles its event loop's thread with cProfile between a
SIGUSR1 (start) and a SIGUSR2 (stop, stats written to PATH), so a bench profiles its load window
only, not start-up. The clock is the thread's CPU time, not wall time: on a shared machine the
time the process waits for a core would otherwise be charged to whatever function it waited in.
Without the variable nothing is installed."""
from __future__ import annotations

import cProfile
import os
import signal
import time

ENV = "CONDUCTOR_PROFILE"


def install() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    prof = cProfile.Profile(time.thread_time)

    def start(_sig: int, _frame: object) -> None:
        prof.enable()  # signal handlers run on the main thread: the event loop's

    def stop(_sig: int, _frame: object) -> None:
        prof.disable()
        prof.dump_stats(path + ".part")
        os.replace(path + ".part", path)  # whole or absent: the bench waits for it

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
