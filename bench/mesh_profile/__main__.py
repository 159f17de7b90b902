from bench.mesh_profile.run import entry

entry()
