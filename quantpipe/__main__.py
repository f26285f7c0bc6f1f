import sys

from quantpipe.cli import main

sys.exit(main())
