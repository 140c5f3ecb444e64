"""The harness the reliability scenarios share (benchmarks/reliability/_faultkit.py)."""

from __future__ import annotations

import pytest

from benchmarks.reliability._faultkit import ChildDied, end, read_json_line, send, spawn

# two lines in one write, then the child waits for the parent: as two_writers' first writer
# does when its "held" line follows a commit line before the parent has read
_TWO_THEN_WAIT = """
import os, sys
os.write(1, b'{"committed": 0}\\nnot json\\n{"held": 1}\\n')
sys.stdin.readline()
os.write(1, b'{"after": 2}')
"""


def test_lines_already_in_the_pipe_are_read_while_the_child_waits():
    p = spawn(_TWO_THEN_WAIT)
    try:
        assert read_json_line(p, timeout=60) == {"committed": 0}
        # the child is silent until told: this line was read from the pipe with the first
        assert read_json_line(p, timeout=60) == {"held": 1}
        send(p, {})
        assert read_json_line(p, timeout=60) == {"after": 2}  # a last line without newline
        with pytest.raises(ChildDied, match=r"exited \(0\)"):
            read_json_line(p, timeout=60)
    finally:
        end(p)


_SILENT = """
import sys
def waiting_for_the_parent():
    sys.stdin.readline()
waiting_for_the_parent()
"""


def test_a_silent_child_is_ended_and_its_stacks_and_what_was_awaited_are_told():
    p = spawn(_SILENT)
    try:
        # the child never speaks: the timeout is what is tested, not a race
        with pytest.raises(TimeoutError) as e:
            read_json_line(p, timeout=0.5, waiting="its pid")
        assert "waited for its pid" in str(e.value)
        assert "waiting_for_the_parent" in str(e.value)  # its stack, by faulthandler
        assert p.poll() is not None
    finally:
        end(p)
