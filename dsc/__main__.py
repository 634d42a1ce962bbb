"""The `dsc` command (and `python -m dsc`).

Importing the CLI imports torch, which takes seconds on a cold start; a Ctrl-C in those seconds
would print a long traceback through torch's imports. Here it ends the command quietly, as a
Ctrl-C later on does (exit 130). Everything else is in `dsc.cli`.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from dsc.cli import app
    except KeyboardInterrupt:
        sys.exit(130)
    app()


if __name__ == "__main__":
    main()
