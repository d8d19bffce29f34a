"""Kubernetes manifests for training (Kubeflow Trainer's TrainJob, or a PyTorchJob) and serving
(KServe's ServingRuntime and InferenceService, or a plain Deployment, Service and autoscaler).

Each function returns plain dicts in the shape the engine's API defines; ``to_yaml`` writes them
as one multi-document file for ``kubectl apply -f``. The engines do the launching: Kubeflow's
torch runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``
and ``PET_MASTER_PORT``, which torchrun reads as its flags; a PyTorchJob sets ``WORLD_SIZE`` and
``RANK`` per pod, which the container passes to torchrun as nodes and node rank.

Training pods run :mod:`torchkeel.cluster.torchrun` (143 after a SIGTERM and its save, which
``restartPolicy: ExitCode`` retries; 2 config error, 1 crash: not retried) with ``grace_s`` to save.
The TrainJob targets Kubeflow Trainer v2.3 (``runtimePatches`` and an integer ``numProcPerNode``
since v2.2, ``terminationGracePeriodSeconds`` in a runtime patch since v2.3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from torchkeel.errors import ConfigError

PVC_MOUNT = "/mnt/keel"
"""Where the run directory's volume is mounted in every pod."""
HTTP_PORT, GRPC_PORT = 8080, 8081
QUEUE_METRIC = "nv_inference_queue_duration_us"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_DNS = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
Manifest = dict[str, Any]


@dataclass
class TrainSpec:
    """What ``keel k8s train`` writes a job for."""

    config: str
    """The config's path inside the container (in the image, or on the volume)."""
    name: str
    nodes: int
    gpus_per_node: int
    image: str
    pvc: str | None = None
    overrides: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None
    namespace: str | None = None
    runtime: str = "torch-distributed"
    """The Kubeflow Trainer runtime (a ClusterTrainingRuntime) of a TrainJob."""
    max_restarts: int = 3
    cpus_per_node: int | None = None
    """CPUs each pod requests; 4 per worker by default (no CPU limit: a limit throttles the step)."""
    memory_per_node: str | None = None
    """Memory each pod requests and is limited to (its ``/dev/shm`` counts in it); 8Gi per worker by default."""
    grace_s: int = 120
    """Seconds a pod has after SIGTERM to save (``terminationGracePeriodSeconds``; Kubernetes': 30)."""

    def validate(self) -> "TrainSpec":
        _check_name(self.name)
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise ConfigError(f"--cpus-per-node must be >= 1, got {self.cpus_per_node}")
        if self.memory_per_node is not None and not _QUANTITY.match(self.memory_per_node):
            raise ConfigError(f"--memory-per-node {self.memory_per_node!r} is not a Kubernetes quantity (e.g. 32Gi)")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if not self.image:
            raise ConfigError("--image is required: the container image with torchkeel and the training code")
        if self.grace_s < 20:
            raise ConfigError(f"--grace-s must leave time to save a checkpoint (>= 20 s), got {self.grace_s}")
        return self

    @property
    def workers_per_node(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)

    def resources(self) -> dict[str, Any]:
        """Each pod's requests and limits: CPUs and memory always (CPU pods too), GPUs when asked."""
        cpus = str(self.cpus_per_node or 4 * self.workers_per_node)
        memory = self.memory_per_node or f"{8 * self.workers_per_node}Gi"
        limits = {"memory": memory, **({"nvidia.com/gpu": str(self.gpus_per_node)} if self.gpus_per_node else {})}
        return {"requests": {"cpu": cpus, "memory": memory}, "limits": limits}

    def torchrun(self) -> list[str]:
        """torchrun with keel's exit codes, up to ``keel``; its workers get ``grace_s - 10`` s to save."""
        wrapper = ["python3", "-m", "torchkeel.cluster.torchrun", f"--max-restarts={self.max_restarts}"]
        return [*wrapper, f"--shutdown-timeout={self.grace_s - 10}", "--no-python", "keel"]

    def keel_args(self) -> list[str]:
        """``keel train``'s arguments; with a volume, the run directory is on it."""
        out_dir = (
            [f"out_dir={PVC_MOUNT}/runs"]
            if self.pvc and not any(o.startswith("out_dir=") for o in self.overrides)
            else []
        )
        return ["train", self.config, "--resume", "auto", "--no-progress", *out_dir, *self.overrides]


def train_job(spec: TrainSpec) -> list[Manifest]:
    """A Kubeflow Trainer ``TrainJob`` on the torch runtime: one pod per node, torchrun in each."""
    spec.validate()
    trainer: dict[str, Any] = {
        "image": spec.image,
        # torchrun takes --nnodes, --node-rank and the master address from the runtime's PET_* variables.
        "command": spec.torchrun(),
        "args": spec.keel_args(),
        "numNodes": spec.nodes,
        "numProcPerNode": spec.workers_per_node,
    }
    trainer["resourcesPerNode"] = spec.resources()
    job: Manifest = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(spec.name, spec.namespace),
        "spec": {
            "runtimeRef": {"name": spec.runtime, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
        },
    }
    volumes, mounts = _volumes(spec)
    containers = [{"name": "node", "volumeMounts": mounts}]  # terminationGracePeriodSeconds: since Trainer v2.3
    pod = {"volumes": volumes, "containers": containers, "terminationGracePeriodSeconds": spec.grace_s}
    job["spec"]["runtimePatches"] = [
        {
            "manager": "torchkeel",
            "trainingRuntimeSpec": {
                "template": {
                    "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}
                }
            },
        }
    ]
    return [job]


def pytorch_job(spec: TrainSpec) -> list[Manifest]:
    """A Kubeflow ``PyTorchJob``: a Master and ``nodes - 1`` Workers. Its ``WORLD_SIZE`` and ``RANK``
    count pods, so they become torchrun's ``--nnodes`` and ``--node-rank``; torchrun then gives each
    worker process its own ``WORLD_SIZE`` and ``RANK`` (processes), which is what keel reads."""
    spec.validate()
    *torchrun, keel = spec.torchrun()
    command = [
        *torchrun,
        "--nnodes=$(WORLD_SIZE)",
        "--node-rank=$(RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        f"--nproc-per-node={spec.workers_per_node}",
        keel,
        *spec.keel_args(),
    ]
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": spec.image,
        "command": command,
        "resources": spec.resources(),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes, "terminationGracePeriodSeconds": spec.grace_s}

    def replica(count: int) -> dict[str, Any]:
        # ExitCode: a pod that exits >= 128 (a signal, after its save) is recreated, 1-127 fail the job.
        return {"replicas": count, "restartPolicy": "ExitCode", "template": {"spec": pod}}

    replicas = {"Master": replica(1), **({"Worker": replica(spec.nodes - 1)} if spec.nodes > 1 else {})}
    return [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": _metadata(spec.name, spec.namespace),
            "spec": {"runPolicy": {"backoffLimit": spec.max_restarts}, "pytorchReplicaSpecs": replicas},
        }
    ]


@dataclass
class ServeSpec:
    """What ``keel k8s serve`` writes a service for."""

    name: str
    image: str
    storage_uri: str
    """Where KServe's storage initializer fetches the export from (``pvc://``, ``s3://``, ``gs://`` ...)."""
    model_format: str = "onnx"
    """The export's format: ``onnx``, ``torchscript`` or ``torch-export``."""
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 4
    cpu: str = "1"
    memory: str = "2Gi"
    gpus: int = 0
    keda_queue_us: float | None = None
    """Scale on the queue: the average queue wait (microseconds per request) one replica may carry."""
    target_cpu_percent: int = 70
    deployment_mode: str = "RawDeployment"
    """KServe's mode: ``RawDeployment`` (a Deployment; HTTP and gRPC ports) or ``Serverless``
    (Knative, which allows one container port: HTTP only, gRPC off)."""

    def validate(self) -> "ServeSpec":
        _check_name(self.name)
        if self.deployment_mode not in DEPLOYMENT_MODES:
            raise ConfigError(
                f"--deployment-mode {self.deployment_mode!r}: choose one of {', '.join(DEPLOYMENT_MODES)}"
            )
        if not self.image:
            raise ConfigError("--image is required: a container image with torchkeel installed")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(
                f"replicas: need 1 <= --min-replicas <= --max-replicas, got {self.min_replicas}, {self.max_replicas}"
            )
        return self


DEPLOYMENT_MODES = ("RawDeployment", "Serverless")
MODEL_FORMATS = {"onnx": "onnx", "torchscript": "pytorch", "torch-export": "pytorch"}
"""KServe's model format names for each export format (TorchScript is KServe's ``pytorch``)."""

STARTUP_FAILURES = 120
"""Startup probes (every 5 s) that may fail before the container is restarted: 10 minutes to load and warm up."""


def _serve_container(spec: ServeSpec, name: str) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "requests": {"cpu": spec.cpu, "memory": spec.memory},
        "limits": {"memory": spec.memory},
    }
    if spec.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(spec.gpus)
    return {
        "name": name,
        "image": spec.image,
        "command": ["keel", "serve"],
        "args": ["--host", "0.0.0.0", "--http_port", str(HTTP_PORT), "--grpc_port", str(GRPC_PORT)],
        "ports": [
            {"containerPort": HTTP_PORT, "name": "http1", "protocol": "TCP"},
            {"containerPort": GRPC_PORT, "name": "h2c", "protocol": "TCP"},
        ],
        # The server listens only once its models are loaded and warm: until then the liveness
        # probe must not count failures, or a slow start is killed and restarted in a loop.
        "startupProbe": {
            "httpGet": {"path": "/v2/health/live", "port": HTTP_PORT},
            "periodSeconds": 5,
            "failureThreshold": STARTUP_FAILURES,
        },
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": HTTP_PORT}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": HTTP_PORT}, "periodSeconds": 10},
        "resources": resources,
    }


def _scrape() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}


def kserve(spec: ServeSpec) -> list[Manifest]:
    """A ``ServingRuntime`` running ``keel serve`` (KServe v1 and v2 protocols, TorchScript and ONNX)
    and an ``InferenceService`` that serves the export at ``storage_uri`` with it."""
    spec.validate()
    container = _serve_container(spec, "kserve-container")
    container["args"] += ["--model_name", "{{.Name}}", "/mnt/models"]
    if spec.deployment_mode == "Serverless":  # Knative routes one port: HTTP (v1, v2, metrics)
        container["ports"] = [p for p in container["ports"] if p["name"] == "http1"]
        container["args"][container["args"].index("--grpc_port") + 1] = "0"
    runtime = {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": _metadata(f"{spec.name}-keel", spec.namespace, annotations=_scrape()),
        "spec": {
            "protocolVersions": ["v1", "v2"],
            "supportedModelFormats": [
                {"name": "onnx", "version": "1", "autoSelect": True},
                {"name": "pytorch", "version": "1", "autoSelect": True},
            ],
            "containers": [container],
        },
    }
    predictor: dict[str, Any] = {
        "minReplicas": spec.min_replicas,
        "maxReplicas": spec.max_replicas,
        "model": {
            "modelFormat": {"name": MODEL_FORMATS[spec.model_format]},
            "runtime": f"{spec.name}-keel",
            "storageUri": spec.storage_uri,
            "protocolVersion": "v2",
        },
    }
    service = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": _metadata(
            spec.name,
            spec.namespace,
            annotations={**_scrape(), "serving.kserve.io/deploymentMode": spec.deployment_mode},
        ),
        "spec": {"predictor": predictor},
    }
    return [runtime, service, *([_scaled_object(spec, spec.name + "-predictor")] if spec.keda_queue_us else [])]


def plain(spec: ServeSpec) -> list[Manifest]:
    """A ``Deployment`` of ``keel serve`` (the export on a volume at /mnt/models), its ``Service``
    and a ``HorizontalPodAutoscaler`` on CPU, or a KEDA ``ScaledObject`` on the queue metric."""
    spec.validate()
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/component": "keel-serve"}
    container = _serve_container(spec, "keel-serve")
    container["args"] += ["/mnt/models"]
    # The endpoints drop the pod while it still serves; then SIGTERM drains what it accepted.
    container["lifecycle"] = {"preStop": {"sleep": {"seconds": 5}}}
    container["volumeMounts"] = [{"name": "models", "mountPath": "/mnt/models", "readOnly": True}]
    pvc = spec.storage_uri.removeprefix("pvc://").split("/", 1)[0]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec.name, spec.namespace, labels=labels),
        "spec": {
            "replicas": spec.min_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape()},
                "spec": {
                    "containers": [container],
                    # SIGTERM drains: in-flight and queued requests are answered before the pod ends.
                    "terminationGracePeriodSeconds": 60,
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": pvc, "readOnly": True}}],
                },
            },
        },
    }
    service = _service(spec, labels)
    if spec.keda_queue_us:
        return [deployment, service, _scaled_object(spec, spec.name)]
    return [deployment, service, _cpu_autoscaler(spec, labels)]


def _service(spec: ServeSpec, labels: dict[str, str]) -> Manifest:
    """The ``Service`` in front of the Deployment's pods: HTTP and gRPC (h2c)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec.name, spec.namespace, labels=labels, annotations=_scrape()),
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"},
                {
                    "name": "grpc",
                    "port": GRPC_PORT,
                    "targetPort": GRPC_PORT,
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
            ],
        },
    }


def _cpu_autoscaler(spec: ServeSpec, labels: dict[str, str]) -> Manifest:
    """A ``HorizontalPodAutoscaler`` of the Deployment on its pods' CPU use."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(spec.name, spec.namespace, labels=labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": spec.target_cpu_percent},
                    },
                }
            ],
        },
    }


def _scaled_object(spec: ServeSpec, target: str) -> Manifest:
    """KEDA scales ``target`` on the average queue wait per request, Triton's autoscaling signal."""
    query = f"sum(rate({QUEUE_METRIC}[1m])) / clamp_min(sum(rate(nv_inference_request_success[1m])), 1)"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(spec.name, spec.namespace),
        "spec": {
            "scaleTargetRef": {"name": target},
            "minReplicaCount": spec.min_replicas,
            "maxReplicaCount": spec.max_replicas,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": "http://prometheus-server.monitoring:9090",
                        "query": query,
                        "threshold": f"{spec.keda_queue_us:g}",
                    },
                }
            ],
        },
    }


class _PlainDumper(yaml.SafeDumper):
    """Writes a part shared by two places (the same pod template, the same env) twice, not as a
    YAML anchor and alias (``&id001``/``*id001``), which reviewers and some tools do not follow."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(manifests: list[Manifest]) -> str:
    """One multi-document YAML file, for ``kubectl apply -f``."""
    return "---\n".join(yaml.dump(m, Dumper=_PlainDumper, sort_keys=False) for m in manifests)


def _metadata(
    name: str, namespace: str | None, *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    if labels:
        meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _volumes(spec: TrainSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A pod's volumes and their mounts: a memory-backed ``/dev/shm`` (DataLoader workers pass
    batches through it; a container's own is 64 MB), and the run directory's claim with ``--pvc``."""
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.pvc:  # the claim first: it is what a reader of the manifest looks for
        claim = {"name": "keel-runs", "persistentVolumeClaim": {"claimName": spec.pvc}}
        return [claim, *volumes], [{"name": "keel-runs", "mountPath": PVC_MOUNT}, *mounts]
    return volumes, mounts


def _check_name(name: str) -> None:
    if not _DNS.match(name) or len(name) > 63:
        raise ConfigError(
            f"name {name!r} is not a Kubernetes name (lowercase letters, digits and '-', starting with a "
            "letter, at most 63 characters); set name=... in the config or pass --name"
        )
