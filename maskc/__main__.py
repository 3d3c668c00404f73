"""`python -m maskc`: the `maskc` command."""

import sys

from maskc.cli import main

sys.exit(main())
