from bench.afd.run import entry

entry()
