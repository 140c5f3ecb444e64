"""`pitstop run` hears from BackupAndRestore as from a plain manager."""

from __future__ import annotations

import json

import keras
import numpy as np

from pitstop.adapters.keras import BackupAndRestore


def test_fit_without_a_backup_reports_a_fresh_start(tmp_path, monkeypatch):
    """With no backup to restore, fit() told `pitstop run` nothing: a restart had no
    "started from scratch" line (a plain manager's restore() says so)."""
    events = tmp_path / "events.jsonl"
    events.write_text("")
    monkeypatch.setenv("PITSTOP_SUPERVISOR", str(events))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), "float32")
    model.fit(x, x[:, :1], epochs=1, verbose=0,
              callbacks=[BackupAndRestore(str(tmp_path / "backup"))])
    told = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in told if e["event"] == "restore"] == \
        [("restore", None)], told
