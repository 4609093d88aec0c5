"""``python -m tensorverse.demo [options]``: the same as ``tensorverse demo``."""

import sys

from tensorverse.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
