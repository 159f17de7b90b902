from bench.router_overhead.run import entry

entry()
