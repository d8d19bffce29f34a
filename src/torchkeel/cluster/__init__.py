"""Running torchkeel under the engines users grow into: an sbatch script for Slurm, manifests
for Kubernetes (Kubeflow Trainer, PyTorchJob, KServe). Each only writes what the engine reads;
the engine launches, rendezvouses and restarts."""
