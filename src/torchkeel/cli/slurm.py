"""``keel slurm CONFIG --nodes N --gpus-per-node G --time HH:MM:SS``: write (and submit) an sbatch script."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from torchkeel.cli.jobflags import add_job_arguments, job_fields
from torchkeel.cli.train import check_job
from torchkeel.cluster.slurm import SlurmJob, sbatch_script
from torchkeel.config.load import load_config
from torchkeel.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (on a filesystem every node mounts)")
    add_job_arguments(parser, "node", "CPUs to ask for per node")
    parser.add_argument("--time", required=True, metavar="HH:MM:SS", help="the job's time limit")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account")
    parser.add_argument(
        "--warn-s", type=int, default=120, help="seconds before the time limit to save and requeue (default 120)"
    )
    parser.add_argument("--join-timeout-s", type=int, default=600, help="rendezvous wait for all nodes (default 600)")
    parser.add_argument(
        "--no-requeue",
        action="store_true",
        help="a stopped job is not requeued (#SBATCH --no-requeue; keel train --no-requeue): it ends FAILED",
    )
    parser.add_argument("--bin-dir", help="where torchrun and keel are on the nodes (default: this environment's)")
    parser.add_argument("-o", "--output", help="script path (default: slurm-<name>.sbatch)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, list(args.overrides))  # a config error is said here, not on the nodes
    job = SlurmJob(
        config=str(Path(args.config).resolve()),
        time=args.time,
        name=config.name,
        partition=args.partition,
        account=args.account,
        warn_s=args.warn_s,
        join_timeout_s=args.join_timeout_s,
        requeue=not args.no_requeue,
        **job_fields(args),
        **({"bin_dir": args.bin_dir} if args.bin_dir else {}),
    )
    script = sbatch_script(job)  # the flags' own checks first
    # The nodes run keel train in the job's directory (--chdir), which puts it on sys.path; the
    # config's imports are checked here as they will resolve there, not from where keel was installed.
    if job.chdir not in sys.path:
        sys.path.insert(0, job.chdir)
    check_job(config, job.nodes * job.workers_per_node)  # what would fail once the job runs, said now
    path = Path(args.output or f"slurm-{config.name}.sbatch")
    path.write_text(script)
    path.chmod(0o755)
    print(f"keel: wrote {path}")
    if not args.submit:
        print(f"keel: submit it with: sbatch {path}")
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError(f"--submit: sbatch is not on PATH here; submit {path} from a Slurm login node")
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {path}: {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
    return 0
