from bench.fleet_replay.run import entry

entry()
