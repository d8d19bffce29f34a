"""Run ``keel`` commands in forks of one process that has imported torch already.

Each ``keel diagnose`` of the corpus spends seconds importing torch before it starts. A fork of a
process that has done so starts at once, and is still a process of its own: the script's changes to
global state (seeds, default dtype, patched functions) die with it. The server is single-threaded
when it forks (nothing has run in torch yet), which is what makes forking safe.

``python forkrun.py`` reads requests from stdin, one JSON line each (``id``, ``argv``, ``cwd``,
``env``, ``timeout_s``), runs ``torchkeel.cli.main.main(argv)`` in a fork with its stdout and stderr
in files, and answers one JSON line per request when its fork ends (``id``, ``rc``, ``stdout``,
``stderr``, ``timed_out``). ``ForkRunner`` is the client; several threads may share it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any


def _child(request: dict[str, Any], out: str, err: str) -> None:
    os.chdir(request["cwd"])
    os.environ.update(request.get("env") or {})
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        from torchkeel.cli.main import main

        code = main(request["argv"]) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on stderr, as a process would
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    import torch  # noqa: F401 - imported once, before any fork

    import torchkeel.cli.main  # noqa: F401
    import torchkeel.diagnose  # noqa: F401

    running: dict[int, tuple[dict[str, Any], str, str, float]] = {}
    pending, stdin_open = b"", True
    while stdin_open or running:
        if stdin_open and select.select([0], [], [], 0.02)[0]:
            data = os.read(0, 1 << 16)
            stdin_open = bool(data)
            pending += data
        elif not stdin_open:
            time.sleep(0.02)
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            folder = tempfile.mkdtemp(prefix="forkrun-")
            out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
            pid = os.fork()
            if pid == 0:
                _child(request, out, err)
            running[pid] = (request, out, err, time.monotonic() + request["timeout_s"])
        for pid, (request, out, err, deadline) in list(running.items()):
            timed_out = False
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
                timed_out = True
            if done:
                del running[pid]
                rc = os.waitstatus_to_exitcode(status)
                reply = {"id": request["id"], "rc": rc, "timed_out": timed_out}
                for key, path in (("stdout", out), ("stderr", err)):
                    with open(path, errors="replace") as fh:
                        reply[key] = fh.read()
                    os.unlink(path)
                os.rmdir(os.path.dirname(out))
                sys.stdout.write(json.dumps(reply) + "\n")
                sys.stdout.flush()


class ForkRunner:
    """The client: ``run(argv, cwd, env, timeout_s)`` → ``subprocess.CompletedProcess``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lock = threading.Lock()
        self.waiting: dict[int, Future] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.lock:
                future = self.waiting.pop(reply["id"])
            future.set_result(reply)
        with self.lock:
            for future in self.waiting.values():
                future.set_exception(RuntimeError("the fork server ended"))

    def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        future: Future = Future()
        with self.lock:
            self.next_id += 1
            request = {"id": self.next_id, "argv": argv, "cwd": str(cwd), "env": env, "timeout_s": timeout_s}
            self.waiting[self.next_id] = future
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        reply = future.result(timeout=timeout_s + 60)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout_s, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(argv, reply["rc"], reply["stdout"], reply["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    serve()
