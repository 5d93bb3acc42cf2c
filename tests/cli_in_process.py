"""`kinema ...` in this process, for tests of what a command refuses: the exit status, stdout and stderr a subprocess
would give (argparse's errors and kinema's own), without a fresh interpreter's imports (2-3 s each). Tests of what a
command does, or of how it ends (signals, exit at interpreter shutdown), run it as a subprocess."""

from __future__ import annotations

import contextlib
import io
import subprocess


def kinema_in_process(*args: str) -> subprocess.CompletedProcess:
    from kinema.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's errors; a message instead of a status is printed and exits 1
            code = exit.code
            if isinstance(code, str):
                print(code, file=err)
                code = 1
    return subprocess.CompletedProcess(["kinema", *args], 0 if code is None else code, out.getvalue(), err.getvalue())
