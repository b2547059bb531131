"""The controller (the driver's process): the state machine, its executors, accounting and tiers."""
