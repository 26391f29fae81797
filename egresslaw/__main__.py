import sys

from egresslaw.cli import main

sys.exit(main())
