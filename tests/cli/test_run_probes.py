"""``pitstop run`` and its hook, attacked as a user running real jobs would (issue 16
probes). Real processes, real signals, real files."""

from __future__ import annotations

import os

import pytest

from pitstop.core import supervised


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_hook_writes_only_to_a_regular_file_it_does_not_reach_through_a_link(
        tmp_path, monkeypatch):
    """PITSTOP_SUPERVISOR inherited by a process that outlives its supervisor names a path
    in a removed private directory; whatever is found there later (a symlink to a user's
    file, a FIFO, a terminal) is not written to."""
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # a write would succeed
    try:
        for name in ("link", "fifo"):
            monkeypatch.setenv(supervised.ENV, str(tmp_path / name))
            supervised.report("open", dir="/somewhere")
        assert victim.read_text() == "mine\n"
        assert os.read(reader, 100) == b""  # nothing was written to the FIFO
    finally:
        os.close(reader)
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"")
    monkeypatch.setenv(supervised.ENV, str(events))
    supervised.report("open", dir="/somewhere")
    assert b'"dir":"/somewhere"' in events.read_bytes()  # the real one still works
