from bench.indexer.run import main

raise SystemExit(main())
