"""The Slurm pool: an ftq worker host whose jobs run as Slurm jobs (docs/slurm.md).

    config.py    BridgeConfig: partition, account, QOS, GPUs per node, environment, shared dir
    commands.py  sbatch, scontrol, squeue, sinfo, scancel: run and parsed (``SlurmCli``)
    script.py    the batch script of one attempt of a job (srun, one torchrun per node)
    states.py    Slurm's job states as the runner's exit and outcome
    bridge.py    the bridge's start: checks, the partition's limits, its worker options
The executor itself is worker/executors/slurm.py.
"""
