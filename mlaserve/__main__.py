"""`python -m mlaserve serve ...`: the same as the `mlaserve` console script."""

import sys

from mlaserve.service.cli import main

if __name__ == "__main__":
    sys.exit(main())
