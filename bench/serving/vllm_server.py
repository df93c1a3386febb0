"""vLLM's OpenAI-compatible server (its CPU backend, from the `.venv-vllm` that `make bench-peers`
creates) as one more system of `pdserve.bench.compare`: started and stopped like a pdserve configuration,
on the same checkpoint, with vLLM's defaults apart from float32, the batch cap and a fixed KV
pool (its CPU default reserves 92% of the host's memory)."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.bench.peers.driver import VLLM_VENV, peer_python
from pdserve.tune.local_server import PdserveServer, PdserveSystem

KV_CACHE_BYTES = 2 << 30


class VllmServer(PdserveServer):
    """`with VllmServer(work_dir, model) as server:` serves on `server.base_url`; its log is kept
    in `work_dir/vllm/serve.log`."""

    def __init__(
        self,
        work_dir: Path,
        model: str,
        max_num_seqs: int = 256,
        venv: Path = VLLM_VENV,
        startup_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(PdserveSystem("vllm"), work_dir, model, startup_timeout_s)
        self.python = peer_python("vllm", venv)
        self.max_num_seqs = max_num_seqs
        # vLLM's own thread binding, and none of this checkout on its path.
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def launch_command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
        ]
