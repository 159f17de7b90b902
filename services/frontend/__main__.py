import sys

from services.frontend.main import main

sys.exit(main())
