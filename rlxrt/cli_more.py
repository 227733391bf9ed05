"""CLI commands that build on export and sessions (export, generate)."""
from __future__ import annotations


def add_commands(add, runtime_flags) -> None:
    """Register the remaining sub-commands on the parser (see rlxrt.cli)."""
