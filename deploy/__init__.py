"""pdserve's deployment files (cluster files, systemd, Slurm, Kubernetes, Grafana, the GPU host's
package lists) and, as `pdserve.deploy.gpu_check`, the GPU host's install check and proving run
(`make gpu-check`)."""
