from bench.faults.run import main

raise SystemExit(main())
