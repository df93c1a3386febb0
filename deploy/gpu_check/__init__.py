"""The GPU check kit: on a GPU host without a package registry, install the prepared wheels and
prove every CUDA path of pdserve in one 10-minute run (`python -m pdserve.deploy.gpu_check`, `make
gpu-check`), leaving a report whose first screen says what failed and how the figures stand.

plan: the steps and their time boxes; runner: runs them; report: the markdown, JSON and logs;
deps and wheels: what the host has and the pinned wheels bring; one module per step."""
