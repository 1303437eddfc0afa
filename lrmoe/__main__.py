"""``python -m lrmoe ...``: the same as the ``lrmoe`` console script."""
import sys

from lrmoe.cli import main

sys.exit(main())
