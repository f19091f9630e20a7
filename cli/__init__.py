"""The ``ftq`` command line: ``up``, ``api``, ``worker``, ``db upgrade``."""
