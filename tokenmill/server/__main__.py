"""`python -m tokenmill.server [MODEL] [flags]`: same as `tokenmill serve`."""

import sys

from tokenmill.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
