import sys

from services.indexer.main import main

sys.exit(main())
