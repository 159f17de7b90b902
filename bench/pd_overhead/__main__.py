from bench.pd_overhead.run import entry

entry()
