from bench.epd.run import entry

entry()
