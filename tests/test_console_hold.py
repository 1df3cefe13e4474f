"""The setup's console output is held until the setup worked, dropped after a user error, released
after a delay otherwise (automodel/training/console_hold.py); the error line goes past the hold."""

from __future__ import annotations

import io
import sys
import time

from automodel.training.console_hold import HeldStream, hold_console
from automodel.training.user_errors import print_user_error


def test_held_lines_are_released_discarded_or_timed_out():
    out = io.StringIO()
    held = HeldStream(out, hold_s=None)
    held.write("setup line\n")
    held.flush()
    assert out.getvalue() == ""
    held.release()
    assert out.getvalue() == "setup line\n"
    held.write("training line\n")  # after the release: straight through
    assert out.getvalue() == "setup line\ntraining line\n"

    out = io.StringIO()
    held = HeldStream(out, hold_s=None)
    held.write("setup line\n")
    held.write_past_hold("error: x\n")
    held.discard()
    held.write("after\n")
    assert out.getvalue() == "error: x\nafter\n"

    out = io.StringIO()
    held = HeldStream(out, hold_s=0.05)  # a long setup: shown after the delay
    held.write("slow setup\n")
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.getvalue() == "slow setup\n"


def test_hold_console_swaps_and_restores_sys_streams(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console = hold_console(hold_s=None)
    print("run directory: ...")
    print("Generating train split", file=sys.stderr)
    print_user_error("bad.jsonl:2 is not valid JSON")  # through the held stderr, at once
    assert (out.getvalue(), err.getvalue()) == ("", "error: bad.jsonl:2 is not valid JSON\n")
    console.discard()
    console.restore()
    assert sys.stdout is out and sys.stderr is err and out.getvalue() == ""
