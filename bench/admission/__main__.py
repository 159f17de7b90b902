from bench.admission.run import entry

entry()
