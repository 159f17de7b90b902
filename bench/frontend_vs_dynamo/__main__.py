from bench.frontend_vs_dynamo.run import entry

entry()
