"""A package, so that the browser tests share one stack (package-scoped fixtures, conftest.py)."""
