"""Start detached processes and stop exactly those later, even from another `kiln` process.

A pid alone is not an identity (pids are reused), so each record keeps the process start
time from /proc as well; stop() signals a pid only while both still match.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


# The processes this one launched: holding their Popen keeps their exit status for reap(), which
# a bare waitpid could lose to subprocess's own clean-up of dropped Popen objects.
_children: dict[int, subprocess.Popen] = {}


def launch(argv: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Start argv in its own session with output to `log`; returns its record."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    _children[proc.pid] = proc
    return {"pid": proc.pid, "start": start_ticks(proc.pid), "argv": argv, "log": str(log)}


def alive(record: dict) -> bool:
    ticks = start_ticks(record["pid"])
    return ticks is not None and ticks == record["start"]


def reap(pid: int) -> int | None:
    """Collect an exited child: its exit code (-N: killed by signal N), or None while it runs or
    where it is not this process's child (init reaps those)."""
    proc = _children.get(pid)
    if proc is not None:
        code = proc.poll()
        if code is not None:
            del _children[pid]
        return code
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None


def exit_code(record: dict) -> int | None:
    """The recorded process's exit code once it exited, also after stop() collected it."""
    _collect(record)
    return record.get("exit")


def _collect(record: dict) -> None:
    """reap, keeping the code in the record: stop() runs on another thread than the one that
    reports the exit, which then found nothing left to collect."""
    code = reap(record["pid"])
    if code is not None:
        record["exit"] = code


def stop(record: dict, grace: float = 10.0) -> None:
    """SIGTERM the recorded process, SIGKILL it after `grace` seconds; no-op if it is gone."""
    if not alive(record):
        _collect(record)
        return
    try:  # it may exit between alive() and the signal: `down` stopped there with a traceback
        os.kill(record["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while alive(record) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(record):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record["pid"], signal.SIGKILL)
    while alive(record):
        time.sleep(0.05)
    # A zombie is not alive(): collected here, on this thread, always. (Collected before each
    # check, one that died between the two was left to the next reap(), the exit code unrecorded.)
    _collect(record)


def log_tail(record: dict, lines: int = 30) -> str:
    try:
        return "\n".join(Path(record["log"]).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
