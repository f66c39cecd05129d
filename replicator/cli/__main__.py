"""``python -m replicator.cli``: the ``mtc`` console script."""

import sys

from replicator.cli import main

sys.exit(main())
