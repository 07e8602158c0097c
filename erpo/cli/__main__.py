"""`python -m erpo.cli ...` is the `erpo` command (as `python -m erpo` is)."""
import sys

from erpo.cli import main

sys.exit(main())
