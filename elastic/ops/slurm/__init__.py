"""The elastic job on a Slurm allocation: ``elastic slurm`` and its sbatch template (``elastic.sbatch``).

One Ray node per Slurm node (the head on the first), the entry point run on the head as a multi-process elastic
job (one worker per slice, placed by ``Processes(resources_per_worker={"elastic_host": 1})``); a lost node is a
slice loss; one-node jobs that join the cluster replace it. See ``docs/guides/slurm.md``.
"""
