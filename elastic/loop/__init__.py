"""The pass runtime: what the user's loop runs with, in the client (single-process mode) and in every worker
process (multi-process mode). :class:`~elastic.loop.run.Run` (the loop's handle: steps, commit, jit, data),
:mod:`~elastic.loop.markers` (step markers), :mod:`~elastic.loop.data` (data positions),
:mod:`~elastic.loop.shardings` (the state's shardings on a mesh) and :class:`~elastic.loop.host.PassHost` (what a
pass asks of the job). Below :mod:`elastic.control` and :mod:`elastic.placements`, which drive passes; above
nothing of theirs: :mod:`elastic.api` (what the user imports) is the one composition root.
"""
