"""`python -m mla_convert.cli`: the `mla-convert` command."""

from mla_convert.cli import main

main()
