"""The run's driver: the controller's step loop and what it drives with (the meshes, the run
directory, generation through the router, evaluation, metrics)."""
