"""Where a slice's devices live: in this process, or in a worker process per slice."""
