"""Fault injection and the chaos suite: the fault plan, the catalogue, the runner, the invariants."""
