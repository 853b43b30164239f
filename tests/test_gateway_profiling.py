"""The opt-in profile of ``conductor serve`` (gateway/profiling.py): nothing without the variable;
with it, SIGUSR1 starts profiling and SIGUSR2 writes the stats, whole."""
import pstats
import signal

import pytest

from gateway import profiling


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_without_the_variable_nothing_is_installed(monkeypatch, handlers):
    monkeypatch.delenv(profiling.ENV, raising=False)
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    profiling.install()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


def test_the_signals_bracket_the_profile_and_write_it(monkeypatch, handlers, tmp_path):
    path = tmp_path / "gateway.prof"
    monkeypatch.setenv(profiling.ENV, str(path))
    profiling.install()

    def busy() -> int:
        return sum(i * i for i in range(20000))

    busy()  # before SIGUSR1: not profiled
    signal.raise_signal(signal.SIGUSR1)  # its handler runs before raise_signal returns
    busy()
    signal.raise_signal(signal.SIGUSR2)
    assert path.exists() and not (tmp_path / "gateway.prof.part").exists()
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    calls = [v[1] for (_, _, fn), v in stats.items() if fn == "busy"]
    assert calls == [1]
