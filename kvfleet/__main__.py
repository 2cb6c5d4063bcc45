"""`python -m kvfleet ...` is the `kvfleet` command."""

import sys

from kvfleet.cli import main

sys.exit(main())
