"""torchrun as a Slurm task or a Kubernetes pod runs it: ``python -m torchkeel.cluster.torchrun <torchrun arguments>``.

This is ``torch.distributed.run.main`` itself, unchanged, except for how it ends when it fails or
is stopped, so that the exit code tells a scheduler what happened:

- stopped by a signal it handles (``--signals-to-handle``; it passes the signal on to its workers,
  waits for them to save, then raises ``SignalException``): one line and 128 + the signal, 143 for
  SIGTERM and for Slurm's warning SIGUSR1, as ``keel train`` exits. torchrun itself would print a
  traceback and exit 1. A run stopped before it finished never exits 0: Slurm records the step
  FAILED, not COMPLETED, and Kubeflow's ``restartPolicy: ExitCode`` retries codes of 128 and up;
- its workers failed (``ChildFailedError``): the first failed worker's exit code (2 for a config
  error, 1 for a crash: Kubeflow's permanent codes; 128 + the signal for a worker that a signal
  killed), with torchrun's summary of the failures, and no traceback. torchrun would exit 1.

Anything else (a rendezvous that times out, a bad flag) ends as torchrun ends it.
"""

from __future__ import annotations

import signal
import socket
import sys

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; its exit code as the module docstring says."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from torchkeel.train.preempt import preempt_exit_code

    try:
        torchrun(argv)
    except SignalException as stopped:
        _ignore_further_stops()
        name = signal.Signals(stopped.sigval).name
        code = preempt_exit_code(name) if name in STOP_SIGNALS else 128 + stopped.sigval
        print(
            f"keel torchrun: {socket.gethostname()}: torchrun passed {name} on and its workers have ended "
            f"(exit {code})",
            file=sys.stderr,
        )
        return code
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(failed.format_msg(), file=sys.stderr)
        print(f"keel torchrun: {socket.gethostname()}: worker rank {rank} failed first; exit {code}", file=sys.stderr)
        return code
    return 0


def _ignore_further_stops() -> None:
    """The workers have ended; a second stop (Slurm signals every process of a job it requeues)
    must not raise torchrun's ``SignalException`` again, as a traceback, while this process ends."""
    for name in STOP_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
