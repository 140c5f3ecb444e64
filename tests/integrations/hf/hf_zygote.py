"""Starts hf_job runs as fresh processes without paying for Python's and transformers'
imports each time (about 5 s of CPU a start): this process imports them once, runs no
training itself, and forks one child per ``run``. Each child is a session of its own (its
DataLoader workers are in its process group, so ``killpg`` reaches them all, as a scheduler's
kill would) and writes its output to a FIFO the test reads.

Commands on stdin, one a line: ``run OUT FIFO`` (answers ``pid N``), ``wait N`` (answers
``exit N CODE``, CODE negative for a signal, as ``Popen.returncode``). ``ready`` is printed
once the imports are done.
"""

from __future__ import annotations

import os
import sys
import traceback

import hf_job


def _child(out: str, fifo: str) -> None:
    os.setsid()
    fd = os.open(fifo, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 0
    try:
        hf_job.main(out)
    except SystemExit as e:          # pitstop's signal save exits as the signal asks
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)           # a normal exit: atexit hooks (pitstop's) run


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "run":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(*args)
            print(f"pid {pid}", flush=True)
        elif cmd == "wait":
            pid = int(args[0])
            _, status = os.waitpid(pid, 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(f"exit {pid} {code}", flush=True)


if __name__ == "__main__":
    main()
