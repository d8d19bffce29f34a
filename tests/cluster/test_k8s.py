"""``keel k8s``: manifests for Kubeflow Trainer, PyTorchJob, KServe and plain Kubernetes.

The core kinds (Deployment, Service, HorizontalPodAutoscaler, and every pod spec inside the
custom kinds) are read back through the ``kubernetes`` client's own models and must serialize to
the same document: a misspelt or misplaced field is dropped by the client and fails here. The
custom kinds are checked against the field names their APIs define (Kubeflow Trainer's
``TrainJobSpec``/``Trainer``, the training operator's ``PyTorchJob``, KServe's ``ServingRuntime``
and ``InferenceService``, KEDA's ``ScaledObject``). The TrainJob's fields are Kubeflow Trainer
v2.3's (``runtimePatches``, an integer ``numProcPerNode``, ``terminationGracePeriodSeconds`` in a
pod patch). A pod's command is run as kubelet runs it: stopped by SIGTERM it exits 143, which
``restartPolicy: ExitCode`` retries, and a config error exits 2, which it does not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from distrun import env, write_config
from kubernetes.client import ApiClient

from torchkeel.cli.main import main
from torchkeel.cluster.k8s import QUEUE_METRIC, ServeSpec, TrainSpec, kserve, plain, pytorch_job, train_job
from torchkeel.errors import ConfigError
from torchkeel.serve.metrics import TRITON_COUNTERS

CLIENT = ApiClient()


def as_model(document: dict, kind: str):
    """The client's model of ``document`` (``kind``: its class, e.g. ``V1Deployment``), checked to
    hold every field of the document: serializing it back gives the document again."""
    model = CLIENT.deserialize(json.dumps(document), kind, "application/json")
    assert CLIENT.sanitize_for_serialization(model) == document
    return model


def train_spec(**changes) -> TrainSpec:
    return TrainSpec(
        **{
            "config": "/app/cfg.yaml",
            "name": "gpt-small",
            "nodes": 3,
            "gpus_per_node": 8,
            "image": "registry.example/keel:1",
            **changes,
        }
    )


TRAINJOB_SPEC = {
    "runtimeRef",
    "initializer",
    "trainer",
    "runtimePatches",
    "suspend",
    "activeDeadlineSeconds",
    "managedBy",
}
TRAINER = {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"}
POD_SPEC_PATCH = {  # Kubeflow Trainer v2.3's PodSpecPatch
    "serviceAccountName",
    "volumes",
    "initContainers",
    "containers",
    "imagePullSecrets",
    "securityContext",
    "nodeSelector",
    "affinity",
    "tolerations",
    "schedulingGates",
    "terminationGracePeriodSeconds",
}
CONTAINER_PATCH = {"name", "env", "volumeMounts", "securityContext"}
WRAPPER = ["python3", "-m", "torchkeel.cluster.torchrun"]


def test_a_trainjob_asks_the_torch_runtime_for_nodes_and_processes_and_mounts_the_volume():
    (job,) = train_job(train_spec(pvc="runs-rwx", overrides=["optim.lr=3e-4"]))
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert set(job["spec"]) <= TRAINJOB_SPEC and set(job["spec"]["trainer"]) <= TRAINER
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["numProcPerNode"] == 8
    as_model(trainer["resourcesPerNode"], "V1ResourceRequirements")
    # torchrun reads --nnodes, --node-rank and the master address from the runtime's PET_* variables.
    assert trainer["command"][:3] == WRAPPER and not any("nnodes" in c for c in trainer["command"])
    assert isinstance(trainer["numProcPerNode"], int)  # v2.2 on: an integer, no longer "auto" or a string
    assert trainer["args"][:5] == ["train", "/app/cfg.yaml", "--resume", "auto", "--no-progress"]
    assert "out_dir=/mnt/keel/runs" in trainer["args"] and trainer["args"][-1] == "optim.lr=3e-4"
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert set(pod) <= POD_SPEC_PATCH and all(set(c) <= CONTAINER_PATCH for c in pod["containers"])
    assert as_model(pod, "V1PodSpec").termination_grace_period_seconds == 120
    as_model(pod["volumes"][0], "V1Volume")
    as_model(pod["containers"][0]["volumeMounts"][0], "V1VolumeMount")
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs-rwx"


def test_a_pytorchjob_turns_its_per_pod_world_size_into_torchrun_nodes():
    (job,) = pytorch_job(train_spec(pvc="runs-rwx"))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for role in replicas.values():
        # ExitCode: a pod stopped by SIGTERM (143) is recreated; a config error (2) fails the job.
        assert role["restartPolicy"] == "ExitCode"
        pod = as_model(role["template"]["spec"], "V1PodSpec")
        assert pod.termination_grace_period_seconds == 120  # not Kubernetes' 30 s: the save fits
        command = pod.containers[0].command
        assert command[:3] == WRAPPER and "--shutdown-timeout=110" in command
        assert pod.containers[0].name == "pytorch"  # the container the operator injects its variables into
    for flag in ("--nnodes=$(WORLD_SIZE)", "--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)", "--nproc-per-node=8"):
        assert flag in command
    assert "Worker" not in pytorch_job(train_spec(nodes=1))[0]["spec"]["pytorchReplicaSpecs"]


def test_every_pod_asks_for_cpus_and_memory_and_gets_a_memory_backed_dev_shm():
    cpu_only = train_spec(gpus_per_node=0, nproc_per_node=2)
    (trainjob,) = train_job(cpu_only)
    (pytorchjob,) = pytorch_job(train_spec(gpus_per_node=0, cpus_per_node=30, memory_per_node="64Gi", max_restarts=5))
    resources = trainjob["spec"]["trainer"]["resourcesPerNode"]
    assert resources == {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    (patch,) = trainjob["spec"]["runtimePatches"]
    pods = [patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]]
    pods += [role["template"] for role in pytorchjob["spec"]["pytorchReplicaSpecs"].values()]
    for pod in pods:
        spec = as_model(pod["spec"], "V1PodSpec")
        assert [v.empty_dir.medium for v in spec.volumes if v.name == "dshm"] == ["Memory"]
        assert [m.mount_path for m in spec.containers[0].volume_mounts if m.name == "dshm"] == ["/dev/shm"]
    master = as_model(pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"], "V1PodSpec")
    assert master.containers[0].resources.requests == {"cpu": "30", "memory": "64Gi"}
    assert master.containers[0].resources.limits == {"memory": "64Gi"}  # no CPU limit: it would throttle
    assert "--max-restarts=5" in master.containers[0].command  # as the TrainJob's torchrun
    with pytest.raises(ConfigError, match="--memory-per-node '64 GB' is not a Kubernetes quantity"):
        pytorch_job(train_spec(memory_per_node="64 GB"))


def test_each_kserve_manifest_says_its_mode_and_serverless_gets_one_port():
    raw_runtime, raw_service = kserve(serve_spec())[:2]
    assert raw_service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert [p["name"] for p in raw_runtime["spec"]["containers"][0]["ports"]] == ["http1", "h2c"]
    runtime, service = kserve(serve_spec(deployment_mode="Serverless"))[:2]
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    container = as_model(runtime["spec"]["containers"][0], "V1Container")
    assert [p.container_port for p in container.ports] == [8080]  # Knative routes one port
    assert container.args[container.args.index("--grpc_port") + 1] == "0"
    with pytest.raises(ConfigError, match="--deployment-mode 'Knative': choose one of RawDeployment, Serverless"):
        kserve(serve_spec(deployment_mode="Knative"))


def test_keel_refuses_a_pytorchjobs_pod_counts_read_as_process_counts(tmp_path):
    write_config(tmp_path)
    variables = {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "PET_NPROC_PER_NODE": "4",
    }
    result = subprocess.run(
        [sys.executable, "-m", "torchkeel.cli.main", "train", "cfg.yaml"],
        cwd=tmp_path,
        env=env(**variables),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "WORLD_SIZE=2 and RANK=1 count pods here (a PyTorchJob with PET_NPROC_PER_NODE=4)" in result.stderr
    assert "Traceback" not in result.stderr


def serve_spec(**changes) -> ServeSpec:
    return ServeSpec(
        **{
            "name": "digits",
            "image": "registry.example/keel:1",
            "storage_uri": "pvc://exports/digits",
            "model_format": "torchscript",
            **changes,
        }
    )


def test_kserve_gets_a_runtime_for_v1_and_v2_and_an_inference_service_that_uses_it():
    runtime, service = kserve(serve_spec())
    assert runtime["kind"] == "ServingRuntime" and runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["spec"]["protocolVersions"] == ["v1", "v2"]
    assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {"onnx", "pytorch"}
    container = as_model(runtime["spec"]["containers"][0], "V1Container")
    assert container.name == "kserve-container"
    assert {(p.container_port, p.name) for p in container.ports} == {(8080, "http1"), (8081, "h2c")}
    assert "{{.Name}}" in container.args and container.args[-1] == "/mnt/models"
    assert service["kind"] == "InferenceService" and service["apiVersion"] == "serving.kserve.io/v1beta1"
    model = service["spec"]["predictor"]["model"]
    assert model == {
        "modelFormat": {"name": "pytorch"},
        "runtime": runtime["metadata"]["name"],
        "storageUri": "pvc://exports/digits",
        "protocolVersion": "v2",
    }
    for manifest in (runtime, service):
        assert manifest["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_plain_kubernetes_gets_a_deployment_service_and_autoscaler_the_client_accepts():
    deployment, service, autoscaler = plain(serve_spec(min_replicas=2, max_replicas=6))
    d = as_model(deployment, "V1Deployment")
    s = as_model(service, "V1Service")
    a = as_model(autoscaler, "V2HorizontalPodAutoscaler")
    assert d.spec.template.metadata.annotations["prometheus.io/port"] == "8080"
    assert d.spec.selector.match_labels == s.spec.selector
    assert d.spec.template.spec.volumes[0].persistent_volume_claim.claim_name == "exports"
    assert d.spec.template.spec.containers[0].readiness_probe.http_get.path == "/v2/health/ready"
    startup = d.spec.template.spec.containers[0].startup_probe  # liveness waits for load and warm-up
    assert startup.http_get.path == "/v2/health/live" and startup.period_seconds * startup.failure_threshold == 600
    assert {p.port for p in s.spec.ports} == {8080, 8081}
    assert a.spec.scale_target_ref.name == d.metadata.name and (a.spec.min_replicas, a.spec.max_replicas) == (2, 6)


def test_keda_scales_on_the_queue_metric_the_server_exposes():
    deployment, service, scaled = plain(serve_spec(keda_queue_us=50_000))
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    assert set(scaled["spec"]) == {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "triggers"}
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and QUEUE_METRIC in trigger["metadata"]["query"]
    assert QUEUE_METRIC in TRITON_COUNTERS and trigger["metadata"]["threshold"] == "50000"
    assert kserve(serve_spec(keda_queue_us=1e4))[2]["spec"]["scaleTargetRef"]["name"] == "digits-predictor"


def test_the_cli_writes_applyable_yaml_and_refuses_bad_names(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    out = tmp_path / "job.yaml"
    assert (
        main(
            [
                "k8s",
                "train",
                "cfg.yaml",
                "--nodes",
                "2",
                "--gpus-per-node",
                "0",
                "--image",
                "i:1",
                "--kind",
                "pytorchjob",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    (job,) = list(yaml.safe_load_all(out.read_text()))
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"] == "run"
    assert not re.search(r"[&*]id\d", out.read_text())  # the Master and Worker pods written out, no anchors
    assert (
        main(["k8s", "train", "cfg.yaml", "name=Bad_Name!", "--nodes", "2", "--gpus-per-node", "0", "--image", "i:1"])
        == 2
    )
    assert "is not a Kubernetes name" in capsys.readouterr().err
    flags = ["--nodes", "3", "--gpus-per-node", "0", "--image", "i:1", "-o", str(tmp_path / "bad.yaml")]
    assert main(["k8s", "train", "cfg.yaml", *flags]) == 2  # 64 samples over 3 pods
    assert "train.batch_size 64 does not divide by the world size 3" in capsys.readouterr().err
    assert not (tmp_path / "bad.yaml").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"nodes": 0}, "--nodes must be >= 1"),
        ({"image": ""}, "--image is required"),
    ],
)
def test_bad_train_specs_are_named(changes, message):
    from torchkeel.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        train_job(train_spec(**changes))


def test_k8s_serve_reads_the_exports_name_and_format(tmp_path, capsys):
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.json").write_text(json.dumps({"name": "Digits_CNN", "format": "onnx"}))
    assert main(["k8s", "serve", str(export), "--image", "i:1"]) == 0
    runtime, service = list(yaml.safe_load_all(capsys.readouterr().out))
    assert service["metadata"]["name"] == "digits-cnn"
    assert service["spec"]["predictor"]["model"]["modelFormat"] == {"name": "onnx"}
    assert service["spec"]["predictor"]["model"]["storageUri"] == "pvc://digits-cnn-models"
    assert main(["k8s", "serve", str(tmp_path), "--image", "i:1"]) == 2
    assert "model.json' not found; pass a directory written by `keel export`" in capsys.readouterr().err
    (export / "model.json").write_text('{"name": "Digits_CNN", "form')  # cut short by a full disk
    assert main(["k8s", "serve", str(export), "--image", "i:1"]) == 2
    err = capsys.readouterr().err
    assert "model.json' is unreadable (JSONDecodeError); export again" in err and "Traceback" not in err


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def start_pod(work, name: str, *overrides: str, max_restarts: int = 3) -> subprocess.Popen:
    """The Master pod of a one-pod PyTorchJob (2 workers), its command run as kubelet runs it:
    ``$(VAR)`` replaced from the variables the operator sets; ``python3`` is this environment's."""
    spec = train_spec(config="cfg.yaml", nodes=1, gpus_per_node=0, nproc_per_node=2, grace_s=30)
    spec.max_restarts = max_restarts
    spec.overrides = [f"name={name}", *overrides]
    (job,) = pytorch_job(spec)
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    variables = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    command = [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], part) for part in container["command"]]
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.Popen(
        command,
        cwd=work,
        env=env(PATH=path, TORCHKEEL_TEST_STEP_FAULTS="sleep:12=2@rank=0", **variables),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step_5(work, name: str, pod: subprocess.Popen) -> None:
    metrics = work / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step": 5,' in metrics.read_text()) and pod.poll() is None:
        assert time.monotonic() < deadline, "the pod did not reach step 5"
        time.sleep(0.2)


def worker_of_rank(pod: subprocess.Popen, rank: int) -> int:
    """The pid of the pod's worker process of ``rank`` (torchrun sets RANK in its environment)."""
    for child in Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank}")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pods")
    write_config(directory)
    return directory


def test_a_pod_stopped_by_sigterm_saves_and_exits_143_which_exitcode_retries(work):
    """Kubernetes sends SIGTERM to the container's first process (eviction, preemption, a drained
    node). Plain torchrun ended with a traceback and exit 1, which ``ExitCode`` takes as permanent."""
    pod = start_pod(work, "pod-term", "train.max_steps=400")
    wait_for_step_5(work, "pod-term", pod)
    pod.send_signal(signal.SIGTERM)
    _, err = pod.communicate(timeout=120)
    stopped = json.loads((work / "runs" / "pod-term" / "summary.json").read_text())
    assert stopped["status"] == "preempted" and stopped["steps"] < 400, err[-3000:]
    assert pod.returncode == 143 and "Traceback" not in err, err[-3000:]


def test_a_pod_whose_config_is_wrong_exits_2_which_exitcode_does_not_retry(work):
    pod = start_pod(work, "pod-bad", "optim.nme=0.1", max_restarts=0)  # torchrun would retry it 3 times
    _, err = pod.communicate(timeout=120)
    assert pod.returncode == 2 and "optim.nme" in err and "Traceback" not in err, err[-3000:]


def test_every_rank_of_a_job_stopped_by_one_ranks_signal_ends_preempted(work):
    """One pod of several gets SIGTERM (its node is drained): every rank stops together after the
    step. A rank that got no signal of its own used to report ``completed`` and exit 0, so rank 0's
    pod (the PyTorchJob's Master) succeeded with the run unfinished. Here rank 1's process alone
    gets the signal, as the ranks of another pod would."""
    # torchrun would restart its workers after a worker's non-zero exit, here in a pod of its own.
    pod = start_pod(work, "pod-peer", "train.max_steps=400", max_restarts=0)
    wait_for_step_5(work, "pod-peer", pod)
    os.kill(worker_of_rank(pod, 1), signal.SIGTERM)  # rank 0 gets none
    _, err = pod.communicate(timeout=120)
    stopped = json.loads((work / "runs" / "pod-peer" / "summary.json").read_text())  # rank 0's
    assert stopped["status"] == "preempted" and stopped["steps"] < 400, err[-3000:]
    assert pod.returncode == 143, err[-3000:]
