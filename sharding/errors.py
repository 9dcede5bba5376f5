"""The project's one error type for what a user must fix (a config key, a file, a value).

It sits in the lowest layer so every layer's own errors can derive from it. Its message
names the key, file or value and the fix; every command (`recsys.console.command`) prints it
as one line, `error: ...`, with no traceback, and exits 1. Any other exception is a bug and
keeps its traceback (on the console and in the command's log).
"""


class UserError(Exception):
    """Raised for input a user must change; see the module docstring."""
