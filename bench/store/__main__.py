from bench.store.run import entry

entry()
