"""``python -m producer_tools``: the ``alpamayo-producer`` command line."""

import sys

from producer_tools.cli import main

sys.exit(main())
