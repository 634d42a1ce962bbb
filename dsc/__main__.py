"""The `dsc` command (and `python -m dsc`).

The CLI imports only light modules (see `dsc.cli`), but a cold start still takes a moment; a
Ctrl-C in it would print a traceback through those imports. Here it ends the command quietly,
as a Ctrl-C later on does (exit 130). Everything else is in `dsc.cli`.
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
