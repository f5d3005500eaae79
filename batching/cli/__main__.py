"""``python -m batching.cli``: the same command line as ``batching``."""

from batching.cli import main

main()
