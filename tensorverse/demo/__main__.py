"""``python -m tensorverse.demo [options]``: the same as ``tensorverse demo``."""

import sys

from tensorverse.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
