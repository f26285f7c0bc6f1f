"""`python -m quantpipe.runtime.server [MODEL] [flags]`: same as `quantpipe serve`."""

import sys

from quantpipe.runtime.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
