"""`python -m erpo ...` is the `erpo` command."""
from erpo.cli import run

run()
