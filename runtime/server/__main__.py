"""`python -m quantpipe.runtime.server [MODEL] [flags]`: `quantpipe serve` for a model path (registry
URIs, models:/NAME@ALIAS, are resolved by `quantpipe serve` itself)."""

import sys

from quantpipe.runtime.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
