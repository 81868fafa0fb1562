"""The stop handler only records the signal (``sweep/stops.py``): it never raises, so a signal cannot surface
from inside a Ray call; a second one is reported and ignored; SIGHUP ignored at start (nohup) stays ignored;
the previous handlers come back afterwards. No cluster needed."""

from __future__ import annotations

import os
import signal

import pytest

from pd_dflash.sweep.options import SweepInterrupted
from pd_dflash.sweep.stops import stop_on_signals


def deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(3):  # the Python-level handler runs at the next bytecode boundaries
        pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_sets_the_request_and_raises_nothing(sig, capfd, hangup_default):
    before = signal.getsignal(sig)
    with stop_on_signals() as stop:
        deliver(sig)  # no exception here, whatever is running
        assert stop.requested and stop.signum == sig
        deliver(signal.SIGTERM)
        assert stop.signum == sig  # the first one counts
        with pytest.raises(SweepInterrupted) as raised:
            stop.check()  # raised by the driver, between Ray calls
        assert raised.value.signum == sig and raised.value.name == sig.name
    assert signal.getsignal(sig) == before
    assert "SIGTERM again: already stopping" in capfd.readouterr().err


def test_a_hangup_ignored_at_start_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals() as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            deliver(signal.SIGHUP)
            assert not stop.requested
            stop.check()  # nothing to raise
    finally:
        signal.signal(signal.SIGHUP, previous)
