"""Suite-wide set-up: the signal dispositions the signal tests rely on, and frameworks
that need a process of their own.

A test run started in the background by a non-interactive shell (``make test &``, a CI
runner started so) inherits SIGINT ignored, and so would every subprocess a test starts;
pitstop rightly leaves an ignored signal alone, so Ctrl+C tests would fail there. Handling
SIGINT as Python does by default here also makes exec'd children start with SIGINT at its
default, as in an interactive terminal.
"""

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

import pitstop

# C++ extensions (DeepSpeed's CPU ops) build in a folder of this run's own: a lock file a
# killed build left in ~/.cache/torch_extensions would make every start wait forever.
_EXTENSIONS = tempfile.mkdtemp(prefix="pitstop-tests-torch-ext-")
os.environ["TORCH_EXTENSIONS_DIR"] = _EXTENSIONS
atexit.register(shutil.rmtree, _EXTENSIONS, True)

# Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default), and a worker's report() waits in a queue of one until a poll takes it: every step
# of a Ray test (tests/integrations/ray, docs/ray.md) took 2 s. At 0.5 s the two steps
# between docs/ray.md's saves (save_every_steps=2, the default on_busy="skip") still outlast
# a small save's persist on a loaded machine, so every save its check counts is made
# (test_ray.py's loop waits instead: at 0.1 s it skipped one); a dead worker is found the
# same way, sooner. The driver hands the variable on to the controller and workers.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: test folders that run only in a pytest process of their own: TensorFlow and the triton
#: that torch imports (through torch.optim -> torch._dynamo) crash when one process loads
#: both. ``pytest tests`` runs each in a subprocess (tests/test_isolated_suites.py);
#: ``pytest tests/adapters/tf`` runs it directly.
from test_isolated_suites import ISOLATED  # noqa: E402  (one list, where it is run)

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(session, config, items) -> None:
    """The framework folders' runs go last and start now, in the background (see
    tests/test_isolated_suites.py): they use the core the main process leaves idle."""
    from test_isolated_suites import Background

    mine = [it for it in items if getattr(it, "originalname", "") ==
            "test_folder_in_its_own_process"]
    if not mine:
        return
    items[:] = [it for it in items if it not in mine] + mine
    config.pitstop_isolated = Background([it.callspec.id for it in mine])
    config.pitstop_isolated.start()


def pytest_sessionfinish(session, exitstatus) -> None:
    background = getattr(session.config, "pitstop_isolated", None)
    if background is not None:
        background.close()
        session.config.pitstop_isolated = None


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    path = Path(collection_path).resolve()
    if path.parent != HERE / "adapters" or path.name not in ISOLATED:
        return None
    asked = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    only_this = bool(asked) and all(a == path or path in a.parents for a in asked)
    return None if only_this else True


@pytest.fixture
def manager(tmp_path: Path):
    """``manager()`` -> a CheckpointManager on a fresh directory (same dir on each call):
    synchronous saves, no signal handlers, no memory tier, so each test is self-contained."""
    made = []

    def make(**kwargs):
        opts = dict(save_on_signals=None, memory_tier=False, async_save=False)
        opts.update(kwargs)
        m = pitstop.CheckpointManager(tmp_path / "ckpt", **opts)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
