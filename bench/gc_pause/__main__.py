from bench.gc_pause.run import entry

entry()
