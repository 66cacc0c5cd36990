"""``python -m leakfree``: the command line (:mod:`leakfree.cli`)."""

import sys

from leakfree.cli import main

if __name__ == "__main__":
    sys.exit(main())
