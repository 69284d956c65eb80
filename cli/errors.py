"""The one exception every command raises for a user's mistake (a flag, a file, a value): the CLI prints its
message in one line and exits with status 2 (cli.main)."""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """A user error the CLI reports in one line (exit code 2)."""
