"""``python -m troubleshooter``: see ``troubleshooter.cli``."""

import sys

from troubleshooter.cli import main

sys.exit(main())
