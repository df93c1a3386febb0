"""No process of a cluster grows with the requests it serves: a few hundred mixed requests (the
soak of `pdserve.bench.soak`, shortened) through `pdserve serve` with one prefill and one decode node,
over tcp and over shm; each process's resident memory is sampled from /proc as they go."""

from __future__ import annotations

import pytest

from pdserve.bench import soak

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# A node that kept one request's KV pages (about 100 KiB here) per request would grow by 20 MiB
# over the second half; one that met a new oneDNN row count per step, by far more.
MAX_GROWTH_MIB = 16


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_no_process_grows_over_the_second_half_of_hundreds_of_requests(transport, tmp_path):
    args = soak.parse_args(
        [
            "--requests",
            "400",
            "--warmup",
            "300",
            "--sample-every",
            "50",
            "--concurrency",
            "16",
            "--max-growth-mib",
            str(MAX_GROWTH_MIB),
            "--transport",
            transport,
            "--work-dir",
            str(tmp_path),
        ]
    )
    result, samples, problems = soak.run(args)
    assert not problems, f"{problems}\n{soak.render(samples)}"
    assert set(result["processes"]) == {"coordinator", "prefill-0", "decode-0"}
    assert [s.requests for s in samples] == list(range(0, 401, 50))
    tally = result["tally"]
    assert tally["failed"] == 0 and tally["completed"] + tally["dropped"] == 700
    assert tally["dropped"] > 0  # clients that leave mid-stream are part of the load
