"""`python -m memplan ...`: the same command line as the `memplan` console script."""
import sys

from memplan.commands.cli import main

sys.exit(main())
