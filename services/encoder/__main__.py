import sys

from services.encoder.main import main

sys.exit(main())
