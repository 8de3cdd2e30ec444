"""Secrets from files: the relay's bearer tokens and the reference server's API key are given as a file
holding them (`--token-file`, `--relay-token-file`, `--api-key-file`), never on the command line or as a flow
parameter, where `ps` and the Prefect UI would show them. One reader for the command line (cli/) and
the fetch stage (tasks/fetch.py)."""

import os
from pathlib import Path


class TokenFileError(ValueError):
    """A token file that cannot be read or holds no token; the message names the option and the file, never
    the token."""


def read_token_file(path: str | os.PathLike, option: str) -> str:
    """The token `path` holds, without surrounding whitespace (a trailing newline). `option` names the
    command-line option or flow parameter it was given by, for the message of a TokenFileError."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"{option} {path}: cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    if not token:
        raise TokenFileError(f"{option} {path} is empty: it must hold the token")
    return token
