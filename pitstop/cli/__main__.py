"""``python -m pitstop.cli``: the same as the ``pitstop`` command."""

import sys

from pitstop.cli import main

sys.exit(main())
