"""The leaf of errors a user can act on: one base class, which the command line turns into one line."""


class UserError(Exception):
    """An error the user can act on: its message says what is wrong and what to change (a setting, a file, a
    command to run first). The command line prints it as one line, `imgest: error: <message>` with exit 2,
    never a traceback."""


class FinalError(Exception):
    """A mixin for a failure that another try of the same task would repeat (a malformed input file): a task's
    retries are not spent on it (`imgest.policy.retry_unless_final`)."""


# What the command line prints as one line: imgest's own errors, and a path the user gave that is not there.
USER_ERRORS = (UserError, FileNotFoundError)
