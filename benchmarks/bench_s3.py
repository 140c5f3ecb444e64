"""Save and restore 256 MiB through s3:// to a moto server on this machine (docs/storage.md).

    .venv/bin/python benchmarks/bench_s3.py

Prints one line per save: MiB/s of the persist (snapshot to committed manifest) and of the
restore into live arrays. Client and server share the machine's cores (moto is pure Python).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np


def main() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
               AWS_DEFAULT_REGION="us-east-1")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env)
    os.environ.update(env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(os.environ["AWS_ENDPOINT_URL"])
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        import pitstop
        boto3.client("s3").create_bucket(Bucket="bench")
        state = {f"w{i}": np.random.default_rng(i).random(16 << 20, dtype=np.float32)
                 for i in range(4)}
        target = {k: np.empty_like(v) for k, v in state.items()}
        mib = sum(v.nbytes for v in state.values()) / 2**20
        with pitstop.CheckpointManager("s3://bench/run", memory_tier=False, keep_last=1) as mgr:
            for step in range(3):
                stats = mgr.save(step, state).result()
                t = time.perf_counter()
                mgr.restore(target)
                r = time.perf_counter() - t
                print(f"{mib:.0f} MiB: save {mib / stats.persist_s:.0f} MiB/s "
                      f"(persist {stats.persist_s:.2f} s), restore {mib / r:.0f} MiB/s ({r:.2f} s)")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
