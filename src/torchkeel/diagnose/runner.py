"""Run a script in this process under a ``Probe``, as ``python script.py ARGS`` would run it."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import traceback
import types
from typing import Any

from torchkeel.diagnose.probe import Probe, StopScript
from torchkeel.errors import ConfigError
from torchkeel.introspect.sites import display_path, is_user_file


@dataclasses.dataclass
class ScriptOutcome:
    """How the script ended: ``exit_status`` as the shell would see it, the script's own error
    (type, message, user file:line, traceback) if it raised, and why it was stopped early."""

    path: str
    argv: list[str]
    exit_status: int = 0
    error: dict[str, Any] | None = None
    stopped: str | None = None
    wall_s: float = 0.0


def run_script(script: str, args: list[str], probe: Probe, *, timeout_s: float | None = None) -> ScriptOutcome:
    """Execute ``script`` as ``__main__`` with ``sys.argv = [script, *args]`` inside ``probe``.

    Raises:
        ConfigError: the script does not exist or does not compile.
    """
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise ConfigError(f"script {script!r} not found: give the path of a Python file after '--'")
    try:
        with open(path, "rb") as fh:
            code = compile(fh.read(), path, "exec")
    except SyntaxError as exc:
        raise ConfigError(f"script {script}: syntax error at line {exc.lineno}: {exc.msg}") from None
    outcome = ScriptOutcome(path=display_path(path), argv=list(args))
    module = types.ModuleType("__main__")
    module.__file__ = path
    saved = (sys.argv, list(sys.path), sys.modules.get("__main__"))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(path))
    sys.modules["__main__"] = module
    timer = _Timer(timeout_s)
    probe.__enter__()  # a failure to instrument is torchkeel's error, not the script's
    try:
        timer.start()
        try:
            exec(code, module.__dict__)
        finally:
            timer.stop()
    except StopScript as stop:
        outcome.stopped = str(stop)
    except SystemExit as exc:
        outcome.exit_status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the script's own error is reported, not lost
        outcome.exit_status = 1
        outcome.error = describe_error(exc)
    finally:
        probe.__exit__(None, None, None)
        sys.argv, sys.path[:] = saved[0], saved[1]
        if saved[2] is not None:
            sys.modules["__main__"] = saved[2]
    outcome.wall_s = probe.facts.wall_s
    return outcome


def describe_error(exc: BaseException) -> dict[str, Any]:
    """Type, first line of the message, the innermost user frame and the formatted traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    site = frames[-1] if frames else None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = str(exc).strip().split("\n")[0]
    return {
        "type": type(exc).__name__,
        "message": message[:500],
        "file": display_path(site.filename) if site else None,
        "line": site.lineno if site else None,
        "traceback": text[-4000:],
    }


class _Timer:
    """Raises ``StopScript`` into the main thread after ``timeout_s`` seconds (SIGALRM)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.previous: Any = None

    def start(self) -> None:
        if not self.timeout_s or threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)

    def _fire(self, signum: int, frame: Any) -> None:
        raise StopScript(f"stopped after {self.timeout_s:g} s (--timeout)")

    def stop(self) -> None:
        if self.previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None
