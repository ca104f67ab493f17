"""``python -m worker ...`` = ``alpamayo-worker ...``."""

import sys

from worker.cli import main

sys.exit(main())
