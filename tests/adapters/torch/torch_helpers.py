"""Helpers shared by the torch adapter tests (imported as a top-level module by pytest)."""

from __future__ import annotations

import torch


def bits(t):
    """The raw bytes of a tensor's values, in logical order (bit-exact comparisons, NaNs too)."""
    return t.detach().clone().contiguous().view(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --------------------------------------------------------------- DataLoader worker helpers
# (module level, so a "spawn" worker can unpickle them)
INIT_MARK = -1


def mark_worker(worker_id: int) -> None:
    """A user's worker_init_fn: leaves a mark the dataset below returns."""
    global INIT_MARK
    INIT_MARK = 100 + worker_id


class MarkedDataset(torch.utils.data.Dataset):
    """Item i is ``[i, INIT_MARK, SIGTERM blocked in this worker (0/1)]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import signal
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return torch.tensor([i, INIT_MARK, int(blocked)])


class GatedDataset(torch.utils.data.Dataset):
    """Item i is ``[i]``. Unpickled in a worker process (spawn, forkserver) it writes
    ``<gate>.started.<pid>`` and waits until the file ``gate`` exists: the worker is held in
    its start-up, before its worker_init_fn, for as long as a test needs."""

    def __init__(self, n: int, gate: str = "") -> None:
        self.n = n
        self.gate = gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)])

    def __setstate__(self, state) -> None:
        import os
        import time

        self.__dict__.update(state)
        if self.gate:
            open(f"{self.gate}.started.{os.getpid()}", "w").close()
            while not os.path.exists(self.gate):
                time.sleep(0.01)
