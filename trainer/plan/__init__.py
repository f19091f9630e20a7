"""What a run will use, decided before any weight is loaded: the machine (``hardware``), the
plan's types (``types``), the ``Feature`` protocol every optimization implements (``feature``),
the memory estimate the activation policy reads (``memory``) and ``planner.plan`` itself.

Importing this package loads nothing: import the module you need.
"""
