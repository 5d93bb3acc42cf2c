"""Commands in this process, for tests of what a command refuses: the exit status, stdout and stderr a subprocess
would give (argparse's errors, kinema's own, an uncaught error as status 1 with its traceback), without a fresh
interpreter's imports (2-5 s each). Tests of what a command does, or of how it ends (signals, exit at interpreter
shutdown), run it as a subprocess."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import traceback
from collections.abc import Callable
from unittest import mock


def in_process(main: Callable[[], int | None], argv: list[str]) -> subprocess.CompletedProcess:
    """`main()` with sys.argv = argv, as the subprocess `argv` would end."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main()
        except SystemExit as exit:  # argparse's errors; a message instead of a status is printed and exits 1
            code = exit.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, 0 if code is None else code, out.getvalue(), err.getvalue())


def kinema_in_process(*args: str) -> subprocess.CompletedProcess:
    from kinema.cli import main

    return in_process(lambda: main(list(args)), ["kinema", *args])
