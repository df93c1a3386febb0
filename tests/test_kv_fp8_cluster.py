"""The FP8 KV cache served disaggregated, for real (`--kv-cache-dtype fp8` on every node of a 1
prefill + 1 decode cluster): the embedded model over tcp from a prefill node of two
tensor-parallel ranks (its pages re-split by heads, scales with them), and a DeepSeek-V2
checkpoint over shm (MLA's latent rows in FP8): every stream equals the offline engine's with an
FP8 cache; the handoff moves FP8 pages and the metric counts their bytes ((head_dim + 4) /
(2 head_dim) of a bfloat16 cache's: 36/64 for the embedded model); a decode node of another KV
dtype refuses the pages and the request fails cleanly, naming the field."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.coordinator.client import CoordinatorClient, SubmitError
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.cache import KVLayout

pytestmark = pytest.mark.cluster

MODEL = "pdserve-stories"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BLOCK_SIZE = 8
CASES = [("stories", "tcp", 2), ("deepseek_v2", "shm", 1)]


@pytest.mark.parametrize(
    "model,transport,prefill_tp", CASES, ids=[f"{m}-{t}-prefill-tp{n}" for m, t, n in CASES]
)
def test_fp8_pages_stream_the_offline_fp8_tokens_and_move_their_bytes(
    model, transport, prefill_tp, checkpoint_dir
):
    model = MODEL if model == "stories" else str(checkpoint_dir(model))  # MLA: latent rows
    offline = LLM(model, kv_cache_dtype="fp8", num_kv_blocks=1024, block_size=BLOCK_SIZE)
    prompts = make_prompts(6, seed=51, lo=10, hi=60)
    expected = expected_outputs(offline, prompts, GREEDY)
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        kv_cache_dtype="fp8",
        node_engines={"prefill-0": {"tensor_parallel_size": prefill_tp}},
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
    ) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        cluster.wait_until_idle()
        moved = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
        )
        assert node.kv_blocks_received == moved
        layout = offline.engine.layout
        assert layout.is_fp8
        sent = moved * layout.bytes_per_block
        cluster.wait_for_report("prefill-0", lambda n: n.kv_bytes_sent >= sent, "bytes sent")
        text = Metrics(cluster.coordinator).render().decode()
        for node_id, direction in (("prefill-0", "sent"), ("decode-0", "received")):
            line = f'pdserve_kv_transfer_bytes_total{{direction="{direction}",node="{node_id}"}}'
            (value,) = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(line)]
            assert float(value) == sent
    bf16 = KVLayout.from_dict({**layout.to_dict(), "dtype": "bfloat16"})
    width = layout.head_dim  # 32 for the embedded model: 36/64 of bf16's bytes
    assert sent / (moved * bf16.bytes_per_block) == (width + 4) / (2 * width)


def test_a_decode_node_of_another_kv_dtype_refuses_the_pages_and_the_request_fails_cleanly():
    prompt = make_prompts(1, seed=52, lo=20, hi=21)[0]
    with Cluster(
        1,
        1,
        model=MODEL,
        kv_cache_dtype="fp8",
        node_engines={"decode-0": {"kv_cache_dtype": "auto"}},
        config=CoordinatorConfig(max_retries=0, heartbeat_timeout_s=3.0, transfer_timeout_s=10.0),
        block_size=BLOCK_SIZE,
    ) as cluster:

        async def submit() -> str:
            async with CoordinatorClient(cluster.client_addr) as client:
                with pytest.raises(SubmitError) as refused:
                    await client.complete(prompt, GREEDY)
            return str(refused.value)

        error = asyncio.run(submit())
        assert "field 'dtype'" in error and "fp8_e4m3" in error, error
        cluster.wait_until_idle()  # every block of both nodes back
