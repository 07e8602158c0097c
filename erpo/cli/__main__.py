"""`python -m erpo.cli ...` is the `erpo` command (as `python -m erpo` is)."""
from erpo.cli import run

run()
