"""The user's side: the job, the loop's Run, the Trainer, data positions, Orbax and Flax adapters."""
