"""`python -m mla_convert.cli`: the `mla-convert` command."""

import os
import sys

from mla_convert.cli import app

# provenance.json records the command as run (argv[0]'s name): the same `cli.py` as before the CLI became a package
sys.argv[0] = os.path.join(os.path.dirname(os.path.dirname(sys.argv[0])), "cli.py")
app(prog_name="python -m mla_convert.cli")
