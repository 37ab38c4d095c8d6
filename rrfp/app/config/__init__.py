"""What a run is told: the config file's sections and keys, their checks, the workload a run names,
and ``TrainConfig``, the one object the rest of the app reads them from."""
