from bench.transfer.run import entry

entry()
