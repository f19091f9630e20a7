"""The one error type of the command line."""


class CliError(Exception):
    """A problem the user can fix; ``ftq`` prints it without a traceback and exits 2."""
