"""The floor every layer stands on: actions and their demands, the errors, the name constraints, the manager seam,
the DP operators and malleable sharing. It imports nothing else of ours and no web server, database, container
engine or metrics exporter (``tests/test_layers.py`` holds it to that), so managers, the scheduler, the simulator
and the service can all depend on it without depending on each other."""
