"""The supervisor side (Ray actors): the supervisor, slice agents, decide, the event stream."""
