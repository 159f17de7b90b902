import sys

from bench.offline.cli import main

sys.exit(main())
