"""Progress output: a redrawn bar on a terminal, plain log lines elsewhere (pure)."""

from __future__ import annotations

import io

from pd_dflash.sweep.progress import Progress, format_duration


def test_terminal_gets_one_redrawn_line_with_events_above_it():
    out = io.StringIO()
    p = Progress(10, tty=True, stream=out)
    p.update(done=3, failed=1, running={"box-b": 1, "box-a": 2}, eta_s=75, force=True)
    p.event("box-b taken out of rotation")
    p.update(done=10, failed=1, running={}, eta_s=0, force=True)
    p.close()
    text = out.getvalue()
    assert "\r\x1b[2K3/10 [#######" in text and "30% | running box-a:2 box-b:1 | failed 1 | ETA 1m15s" in text
    event = text.index("box-b taken out of rotation\n")
    assert text.rfind("\r\x1b[2K", 0, event) > text.index("3/10")  # the bar is cleared before the event...
    assert text.index("3/10", event) > event  # ...and redrawn after it
    assert text.endswith("10/10 [########################] 100% | running - | failed 1 | ETA 0s\n")


def test_logs_get_plain_lines_at_each_tenth_and_every_event():
    out = io.StringIO()
    p = Progress(100, tty=False, stream=out, every_s=3600)
    for done in range(0, 101):
        p.update(done=done, failed=0, running={"b": 2}, eta_s=None)
    p.event("done")
    lines = out.getvalue().splitlines()
    assert all(line.startswith("[pd-dflash ") for line in lines)
    progress = [line for line in lines if "progress" in line]
    assert len(progress) == 11 and "\r" not in out.getvalue() and "[#" not in out.getvalue()
    assert progress[-1].endswith("progress 100/100 100% | running b:2 | failed 0 | ETA ?")


def test_durations_read_naturally():
    assert [format_duration(s) for s in (None, 5, 75, 3725)] == ["?", "5s", "1m15s", "1h02m"]
