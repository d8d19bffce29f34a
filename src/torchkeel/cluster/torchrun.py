"""torchrun as a Slurm task runs it: ``python -m torchkeel.cluster.torchrun <torchrun arguments>``.

This is ``torch.distributed.run.main`` itself, unchanged, except for how it ends when the job
signals it. torchrun passes a handled signal (``--signals-to-handle``) to its workers, waits for
them to save, and then raises ``SignalException``: a traceback in the job log and exit code 1,
which ``srun`` reports as ``srun: error: ... exit code 1``. Stopping for a signal the job asked for
is the normal end of a time-limited run, so here it is one line and exit code 0; the batch shell
requeues the job. Any other failure ends as torchrun ends it.
"""

from __future__ import annotations

import signal
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; 0 when it stopped its workers for a handled signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stopped:
        name = signal.Signals(stopped.sigval).name
        print(
            f"keel slurm: {socket.gethostname()}: torchrun passed {name} on and its workers have ended", file=sys.stderr
        )
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
