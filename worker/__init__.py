"""The Celery worker: claims a job, runs ``python -m trainer run job.json``, stores its events.

    app.py       Celery app + per-process set-up (``worker_process_init``)
    tasks.py     ``jobs.run`` and ``jobs.reap``
    runner.py    one job from claim to final state
    process.py   the trainer child in its own process group
    recorder.py  trainer events → store rows, in batches
    outcome.py   how a trainer exit becomes a job state
    reaper.py    jobs whose worker vanished, messages that were lost
    presence.py  the worker row: hardware, heartbeat, the reaper loop
    runtime.py   what one worker process holds: store, Redis, identity, options
"""
