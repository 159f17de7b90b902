import sys

from services.store_master.main import main

sys.exit(main())
