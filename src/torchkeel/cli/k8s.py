"""``keel k8s train CONFIG ...`` and ``keel k8s serve EXPORT_DIR ...``: write Kubernetes manifests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchkeel.cluster.k8s import ServeSpec, TrainSpec, kserve, plain, pytorch_job, to_yaml, train_job
from torchkeel.config.load import load_config
from torchkeel.distributed.rank import per_rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_subparsers(dest="what", metavar="train|serve")
    what.required = True
    train = what.add_parser("train", help="a Kubeflow TrainJob (or PyTorchJob) that runs keel train with torchrun")
    train.add_argument("config", help="YAML config; --config-path says where it is inside the container")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    train.add_argument("--nodes", type=int, required=True)
    train.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per pod (0: CPU)")
    train.add_argument("--image", required=True, help="container image with torchkeel and the training code")
    train.add_argument("--pvc", help="PersistentVolumeClaim (ReadWriteMany) for the run directory, at /mnt/keel")
    train.add_argument("--kind", choices=["trainjob", "pytorchjob"], default="trainjob")
    train.add_argument("--nproc-per-node", type=int, help="workers per pod (default: the GPUs, or 1)")
    train.add_argument("--cpus-per-node", type=int, help="CPUs each pod requests (default: 4 per worker)")
    train.add_argument(
        "--memory-per-node", help="memory each pod requests and is limited to, e.g. 64Gi (default: 8Gi per worker)"
    )
    train.add_argument("--max-restarts", type=int, default=3, help="worker failures torchrun recovers from")
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
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        image=args.image,
        pvc=args.pvc,
        overrides=list(args.overrides),
        nproc_per_node=args.nproc_per_node,
        namespace=args.namespace,
        runtime=args.runtime,
        cpus_per_node=args.cpus_per_node,
        memory_per_node=args.memory_per_node,
        max_restarts=args.max_restarts,
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
