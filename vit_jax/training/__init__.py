"""The training loop, its update step, the mesh and model set-up, the train state's checkpoints,
a run's workdir."""
