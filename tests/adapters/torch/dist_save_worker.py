"""A rank of a test world running the multi-rank save scenarios (dist_save_scenarios.py)
next to dist_worker.py's own: ``python dist_save_worker.py <scenario> <rank> ...`` as
dist_worker.py takes it."""

import sys

import dist_save_scenarios  # noqa: F401 - registers its scenarios
import dist_worker

if __name__ == "__main__":
    sys.exit(dist_worker.main(sys.argv[1:]))
