"""Errors the store raises for the CLI to turn into one line and exit code 2.

`InputError` is bad user input (a file, an option); `StoreError` is a database that cannot be
used or a request the queue's state refuses (unknown job, cancelling a finished job);
`OutputError` an output file that cannot be written. Each carries a message written for the
person at the terminal, saying what is wrong and where.
"""

from __future__ import annotations


class InputError(ValueError):
    """The user's input is wrong; nothing was written."""


class StoreError(RuntimeError):
    """The store cannot do what was asked; nothing was written."""


class DatabaseUnavailable(StoreError):
    """The database cannot be opened, read or reached."""


class NotFoundError(StoreError):
    """What was asked for (a file, a batch) is not in the store."""


class OutputError(RuntimeError):
    """A file the user asked for cannot be written (a full disk, a closed pipe); whatever was
    there before is unchanged."""
