"""The Celery worker: claims a job, runs its trainer through an executor, stores its events.

    app.py        Celery app + per-process set-up (``worker_ready``, ``worker_shutdown``)
    tasks.py      ``jobs.run``, ``jobs.run_node``, ``jobs.reap``, ``exports.run``
    runtime.py    what one worker process holds: store, Redis, options
    identity.py   this machine's worker key id and address, for its row
    runner.py     one job from claim to final state: claim, pick the executor, drive it, record
    claim.py      what a claim holds: attempt, output dir, GPUs, executor name
    prepare.py    job.json from the stored spec; checkpoints the store does not know set aside
    watchdog.py   a running job's heartbeat; cancel, shutdown, lost claim → executor signals
    executors/    what runs the trainer: ``Executor`` protocol (base.py), registry and ``choose``
                  (__init__.py), ``local``, ``torchrun``, ``multi_machine``
    launch.py     the trainer's and torchrun's command lines, the trainer's environment
    process.py    the trainer's processes: own session, run tag, stdout events, stderr tail
    nodes.py      multi-machine jobs: parts recorded at the claim, lost machines
    follower.py   a follower machine's part of a multi-machine job (``jobs.run_node``)
    remote.py     a remote worker's downloads and uploads through the API (transfer.py)
    recorder.py   trainer events → store rows, in batches
    outcome.py    how a trainer exit becomes a job state (oom.py: the kernel's OOM counters)
    reaper.py     jobs whose worker vanished, messages that were lost
    presence.py   the worker row: hardware, heartbeat, the reaper loop
    exports.py    ``exports.run``: a finished job's export process
    tracking/     experiment trackers fed with the job's events
"""
