import sys

from loadtest.chaos.run import main

sys.exit(main())
