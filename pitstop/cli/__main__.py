"""``python -m pitstop.cli``: the same as the ``pitstop`` command."""

import sys

from . import main

sys.exit(main())
