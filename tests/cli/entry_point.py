"""Run ``python -m pitstop.cli`` several times in ONE interpreter: each command is the entry
point's own code (``runpy`` of ``pitstop.cli``, as ``-m`` runs it), its stdout and stderr
files of their own on file descriptors 1 and 2 (so the streams keep the encoding and
error handling the environment gives them, and are no terminal); an exception the entry
point lets out is printed as the interpreter would (a traceback, status 1). One start of
an interpreter instead of one per command: most of a command's time is its start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: argv[1]: a JSON list of argv lists; prints [[status, stdout, stderr], ...] as JSON
CHILD = r"""
import json, os, runpy, sys, tempfile, traceback
results = []
for argv in json.loads(sys.argv[1]):
    files = [tempfile.TemporaryFile() for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    sys.argv = ["pitstop", *argv]
    try:
        runpy.run_module("pitstop.cli", run_name="__main__", alter_sys=True)
        status = 0  # (__main__ ends with sys.exit: not reached)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter does with it: a traceback, status 1
        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            if not stream.closed:
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
        f.close()
    results.append([status, *texts])
print(json.dumps(results))
"""


def run_commands(argvs: list[list[str]], env: dict[str, str] | None = None,
                 cwd: str | None = None, timeout: float = 120) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of ``pitstop ARGV`` for each argv, in order."""
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([list(map(str, a))
                                                                   for a in argvs])],
                       capture_output=True, text=True, errors="replace", timeout=timeout,
                       env=env if env is not None else dict(os.environ), cwd=cwd)
    assert r.returncode == 0 and r.stderr == "", r
    results = json.loads(r.stdout)
    assert len(results) == len(argvs), r.stdout
    return [(rc, out, err) for rc, out, err in results]
