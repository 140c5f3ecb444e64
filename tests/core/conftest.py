"""The core's test folders mirror its subpackages; a test of one imports another's helpers by
module name (the memory tier's crash-in-a-persist child, the CLI-free state builders), so every
folder of tests/core is importable whichever test pytest imports first."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in sorted(p for p in HERE.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
