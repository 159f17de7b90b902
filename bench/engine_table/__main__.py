from bench.engine_table.run import entry

entry()
