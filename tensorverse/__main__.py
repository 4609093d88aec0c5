"""`python -m tensorverse` is the `tensorverse` command."""

import sys

from tensorverse.cli import main

sys.exit(main())
