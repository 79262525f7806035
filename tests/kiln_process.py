"""`kiln serve` and `kiln router` as real processes for the tests: started on a free port of
127.0.0.1 from this checkout, waited on until a probe answers 200, their output kept."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def spawned_ranks(pid: int | None = None) -> list[psutil.Process]:
    """The tensor-parallel ranks spawned below process PID (this one by default); not
    multiprocessing's resource tracker. A child that exited and is not yet collected (a zombie)
    or is gone is no rank: reading its command line raised, failing whichever test looked."""
    ranks = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):
            if "spawn_main" in " ".join(child.cmdline()):
                ranks.append(child)
    return ranks


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def refused_at_start(args: list[str], capsys, caplog) -> str:
    """`kiln serve ARGS` in this process, which must stop with exit code 2 before it loads anything
    (argparse's check or the server's own); what it said. In-process: a process per case paid
    torch's import, seconds on a busy CPU, for checks made before any model is touched."""
    from kiln.cli import main
    capsys.readouterr()  # only what this start says
    caplog.clear()
    try:
        code = main(["serve", *args])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    said = capsys.readouterr().err + caplog.text
    assert code == 2, said
    return said


class KilnProcess:
    """`python -m kiln.cli <command...> --host 127.0.0.1 --port <free>` until `probe` answers 200."""

    def __init__(self, command: list[str], probe: str = "/ready", timeout: float = 300,
                 env: dict[str, str] | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kiln.cli", *command, "--host", "127.0.0.1", "--port", str(self.port)]
        launched = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while get(self.url + probe)[0] != 200:
                assert self.proc.poll() is None, f"kiln {command[0]} died:\n" + "".join(self.log)
                assert time.monotonic() < deadline, f"kiln {command[0]} never answered {probe}:\n" + "".join(self.log)
                time.sleep(0.1)
        except BaseException:  # no caller holds it to stop: left running (its TP ranks too), or a zombie
            self.stop()
            raise
        self.ready_after = time.monotonic() - launched  # an upper bound of the process's own cold start

    def stop(self, graceful: bool = False) -> None:
        """SIGKILL (tests that are done with it), or SIGTERM and wait for its drain."""
        if self.proc.poll() is None:
            if graceful:
                self.proc.terminate()
            else:
                self.proc.kill()
        self.proc.wait(timeout=60)


class RouterProcess(KilnProcess):
    """`kiln router --endpoints <endpoints> <extra...>` in front of static engine addresses."""

    def __init__(self, *endpoints: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        super().__init__(["router", "--endpoints", ",".join(endpoints), *extra], timeout=60, env=env)
