"""`python -m tokenweir ...`: the same entry point as the `tokenweir` console script."""

import sys

from tokenweir.cli import main

sys.exit(main())
