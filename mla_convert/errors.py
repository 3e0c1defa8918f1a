"""User-facing errors.

A `UserError` is raised for anything the user can fix (bad option, missing file, unsupported model). Its message is
one line that names the fix. The CLI prints it as `error: <message>` and exits with status 2, without a traceback.
Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by input the user can fix; the message names the fix."""
