"""Keras file writes in a folder another user can write (a shared /tmp): the temporary
beside the file must not be a name another user can predict and plant a symlink at."""

from __future__ import annotations

import os

import keras
import numpy as np

from pitstop.adapters.keras import files
from pitstop.core.storage import sidecar


def _model():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss="mse")
    return m


def test_a_symlink_planted_at_the_temporary_name_is_never_written_through(tmp_path):
    """The temporary was ``.<file>.<pid>-<counter>.pitstop-tmp<ext>`` (counter from 0), and
    it was opened following symlinks: another user who planted symlinks at the next names
    (in /tmp) had the save overwrite a file of the victim's (as root: any file). Now the
    name holds 12 random digits and the file is created O_EXCL | O_NOFOLLOW."""
    os.chmod(tmp_path, 0o1777)  # like /tmp
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_text("precious")
    target = str(tmp_path / "model.keras")
    pid = os.getpid()
    token = sidecar._tmp_name(target).split(f".{pid}-")[1].split(".")[0]
    nxt = int(token[:-12] if len(token) > 12 else token) + 1  # the counter's next value
    for i in range(nxt, nxt + 4):  # what a guess of the old names would plant
        for name in (f".model.keras.{pid}-{i}.pitstop-tmp.keras",
                     f".model.keras.pitstop.{pid}-{i}.pitstop-tmp.pitstop"):
            os.symlink(victim, tmp_path / name)
    model = _model()
    files.write(files.snapshot(model, target, weights_only=False), target)
    assert victim.read_text() == "precious"
    assert files.verify_file(target)
    loaded = keras.models.load_model(target)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    names = sidecar._tmp_name(target), sidecar._tmp_name(target)
    assert names[0] != names[1] and sidecar._TMP.match(os.path.basename(names[0]))
