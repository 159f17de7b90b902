from bench.replay.run import entry

entry()
