import sys

from services.planner.main import main

sys.exit(main())
