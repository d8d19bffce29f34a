"""``keel k8s train CONFIG ...`` and ``keel k8s serve EXPORT_DIR ...``: write Kubernetes manifests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchkeel.cli.jobflags import add_job_arguments, job_fields
from torchkeel.cluster.k8s import ServeSpec, TrainSpec, kserve, plain, pytorch_job, to_yaml, train_job
from torchkeel.config.load import load_config
from torchkeel.distributed.rank import per_rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_subparsers(dest="what", metavar="train|serve")
    what.required = True
    train = what.add_parser("train", help="a Kubeflow TrainJob (or PyTorchJob) that runs keel train with torchrun")
    train.add_argument("config", help="YAML config; --config-path says where it is inside the container")
    add_job_arguments(train, "pod", "CPUs each pod requests (default: 4 per worker)")
    train.add_argument("--image", required=True, help="container image with torchkeel and the training code")
    train.add_argument("--pvc", help="PersistentVolumeClaim (ReadWriteMany) for the run directory, at /mnt/keel")
    train.add_argument("--kind", choices=["trainjob", "pytorchjob"], default="trainjob")
    train.add_argument(
        "--memory-per-node", help="memory each pod requests and is limited to, e.g. 64Gi (default: 8Gi per worker)"
    )
    train.add_argument(
        "--grace-s",
        type=int,
        default=120,
        help="seconds a pod has after SIGTERM to save a checkpoint (terminationGracePeriodSeconds; default 120)",
    )
    train.add_argument("--config-path", help="the config's path inside the container (default: as given)")
    train.add_argument("--runtime", default="torch-distributed", help="TrainJob runtime (ClusterTrainingRuntime)")
    train.add_argument("--namespace")
    train.add_argument("-o", "--output", help="write here instead of standard output")
    serve = what.add_parser("serve", help="a KServe ServingRuntime and InferenceService (or --plain Deployment)")
    serve.add_argument("export_dir", help="a directory written by keel export (its model.json names the format)")
    serve.add_argument("--image", required=True, help="container image with torchkeel installed")
    serve.add_argument("--storage-uri", help="where the export is in the cluster (default pvc://<name>-models)")
    serve.add_argument("--plain", action="store_true", help="Deployment, Service and HorizontalPodAutoscaler")
    serve.add_argument(
        "--deployment-mode",
        choices=["RawDeployment", "Serverless"],
        default="RawDeployment",
        help="KServe's mode (default RawDeployment: HTTP and gRPC ports; Serverless: Knative, HTTP only)",
    )
    serve.add_argument("--keda-queue-us", type=float, help="KEDA ScaledObject on the average queue wait (us)")
    serve.add_argument("--min-replicas", type=int, default=1)
    serve.add_argument("--max-replicas", type=int, default=4)
    serve.add_argument("--gpus", type=int, default=0)
    serve.add_argument("--name", help="service name (default: the model's name)")
    serve.add_argument("--namespace")
    serve.add_argument("-o", "--output", help="write here instead of standard output")


def run(args: argparse.Namespace) -> int:
    manifests = _train(args) if args.what == "train" else _serve(args)
    text = to_yaml(manifests)
    if args.output:
        Path(args.output).write_text(text)
        print(f"keel: wrote {args.output} ({', '.join(m['kind'] for m in manifests)}); apply it with kubectl apply -f")
    else:
        sys.stdout.write(text)
    return 0


def _train(args: argparse.Namespace) -> list:
    config = load_config(args.config, list(args.overrides))
    spec = TrainSpec(
        config=args.config_path or args.config,
        name=config.name.replace("_", "-").lower(),
        image=args.image,
        pvc=args.pvc,
        namespace=args.namespace,
        runtime=args.runtime,
        memory_per_node=args.memory_per_node,
        grace_s=args.grace_s,
        **job_fields(args),
    )
    # The pods' files (code in the image, data on the volume) need not be here: the batch's split is.
    per_rank(config.train.batch_size, spec.nodes * spec.workers_per_node)
    return pytorch_job(spec) if args.kind == "pytorchjob" else train_job(spec)


def _serve(args: argparse.Namespace) -> list:
    from torchkeel.export.formats import read_model_json  # imports torch: only for k8s serve

    meta = read_model_json(args.export_dir)
    name = (args.name or str(meta["name"])).replace("_", "-").lower()
    spec = ServeSpec(
        name=name,
        image=args.image,
        storage_uri=args.storage_uri or f"pvc://{name}-models",
        model_format=meta["format"],
        namespace=args.namespace,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        gpus=args.gpus,
        keda_queue_us=args.keda_queue_us,
        deployment_mode=args.deployment_mode,
    )
    return plain(spec) if args.plain else kserve(spec)
