"""The GPU check kit: on a GPU host without a package registry, install the prepared wheels and
run every CUDA path of pdserve the host's GPUs allow in one 10-minute run (`python -m
pdserve.deploy.gpu_check`, `make gpu-check`), leaving a report whose first screen says what it
proved, what failed, what it could not prove there and why (NCCL and tensor parallelism need two
GPUs or more), and how the figures stand.

plan: the steps and their time boxes; runner: runs them; report: the markdown, JSON and logs;
deps and wheels: what the host has and the pinned wheels bring; one module per step."""
