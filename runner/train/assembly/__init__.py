"""A run's build on one rank: the assembly (assemble.py), the build every program that runs
the model shares (build.py), the run object and its services (run.py, services.py), the
ranks' handshake, the data streams and the seeds."""
