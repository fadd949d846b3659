"""Start ftllm's server with the API key, keeping the key off every command line and environment.

ftllm 0.1.8.2 takes its key only as `--api_key KEY`, where every local user could read it (/proc/PID/cmdline).
The unit runs this file instead, with the Python of ftllm's venv (a release carries it as launch/ftllm_launch.py):

    {venv}/bin/python {current}/launch/ftllm_launch.py KEY_FILE FTLLM_CONSOLE_SCRIPT server -p ... --port 8082

KEY_FILE is the unit's systemd credential (`%d/api-key`: /run/credentials/UNIT/api-key, readable by the service
alone). The launcher reads the key's first line, appends `--api_key KEY` to ftllm's argv in memory (sys.argv:
the kernel's copy of the command line, /proc/PID/cmdline, keeps the line above) and runs the console script in
this same process, so ftllm parses its arguments as always. The key is the last argument: whatever precedes it,
the credential is what ftllm serves with (its argparse keeps the last value). ftllm logs its whole argument
namespace at start (`logging.info(args)`, server.py): a log record factory masks the key in every log message,
so it does not reach the journal either.

Standard library only (this runs in the backend's venv, not deploytool's). Exit 2 with one line on stderr when
the key file is missing or empty, or the console script cannot be read.
"""

from __future__ import annotations

import logging
import runpy
import sys

MASK = "<api key>"


def read_key(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.readline().strip()


def mask_logs(key: str) -> None:
    """Replace the key (as written and as repr() shows it) in every log message of this process with MASK."""
    forms = {key, repr(key)[1:-1]}
    make = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        rec = make(*args, **kwargs)
        try:
            text = rec.getMessage()
        except Exception:  # a broken format: logging reports it when the record is emitted
            return rec
        if any(f in text for f in forms):
            for f in forms:
                text = text.replace(f, MASK)
            rec.msg, rec.args = text, None
        return rec

    logging.setLogRecordFactory(factory)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: ftllm_launch.py KEY_FILE FTLLM_CONSOLE_SCRIPT ARGS...", file=sys.stderr)
        return 2
    key_file, script, args = argv[1], argv[2], argv[3:]
    try:
        key = read_key(key_file)
    except OSError as exc:
        print(f"ftllm_launch: cannot read the API key from {key_file}: {exc.strerror}; is the unit's "
              f"LoadCredential= there and the key file installed?", file=sys.stderr)
        return 2
    if not key:
        print(f"ftllm_launch: the API key file {key_file} is empty", file=sys.stderr)
        return 2
    try:
        with open(script, "rb"):
            pass
    except OSError as exc:
        print(f"ftllm_launch: cannot read the ftllm console script {script}: {exc.strerror}", file=sys.stderr)
        return 2
    mask_logs(key)
    sys.argv = [script, *args, "--api_key", key]
    runpy.run_path(script, run_name="__main__")  # the console script ends in sys.exit(main())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
