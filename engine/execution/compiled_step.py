"""A compiled model step: `torch.compile` of the model's forward, the KV writes and paged attention
kept as opaque custom ops (they read block tables on the host), the token count padded to buckets
(powers of two, as CUDA graphs bucket batch sizes) so that shapes, and so recompiles, stay few.
Padded tokens write no KV (slot -1) and attend nothing; their rows are dropped.

Compiling needs a C++ compiler on CPU; where it is missing or compiling fails, the step runs
eagerly and a warning says why (`runs_compiled` tells which)."""

from __future__ import annotations

import logging
import shutil
import time

import torch

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool, layer_planes
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.kernels import mla_ref, rotary_ref
from pdserve.kernels.op_table import Ops

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, Ops] = {}  # the eager ops the custom ops call, by name


@torch.library.custom_op("pdserve::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
) -> None:
    _BACKENDS[backend].store_kv(key, value, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("pdserve::store_latent", mutates_args=("cache",))
def _store_latent(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str
) -> None:
    _BACKENDS[backend].store_latent(latent, cache, slot_mapping)


@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def _paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    backend: str,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    real = int(query_start_loc[-1])  # the rows past it are padding
    out = torch.zeros_like(query)
    out[:real] = _BACKENDS[backend].paged_attention(
        query[:real],
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        window=window,
        chunk=chunk,
        sinks=sinks,
    )
    return out


@_paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, backend, *rest):
    return torch.empty_like(query)


@torch.library.custom_op("pdserve::fused_moe", mutates_args=())
def _fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _BACKENDS[backend].fused_moe(hidden, w13, w2, topk_weights, topk_ids)


@_fused_moe.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, backend):
    return torch.empty_like(hidden)


def _opaque_ops(ops: Ops) -> Ops:
    """`ops` with its KV write, attention and experts behind the custom ops (the reference MoE
    groups tokens by expert with counts read on the host), and the reference rotary: the CPU one
    writes each half through `out=` into a view, which dynamo cannot trace, while inductor fuses
    the reference's concatenations and products into one loop anyway."""
    from dataclasses import replace

    _BACKENDS[ops.name] = ops

    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        torch.ops.pdserve.store_kv(key, value, k_cache, v_cache, slot_mapping, ops.name)

    def paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=None,
        *,
        window=0,
        chunk=0,
        sinks=None,
    ):
        return torch.ops.pdserve.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            ops.name,
            window,
            chunk,
            sinks,
        )

    def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
        return torch.ops.pdserve.fused_moe(hidden, w13, w2, topk_weights, topk_ids, ops.name)

    def store_latent(latent, cache, slot_mapping):
        torch.ops.pdserve.store_latent(latent, cache, slot_mapping, ops.name)

    return replace(
        ops,
        store_kv=store_kv,
        paged_attention=paged_attention,
        fused_moe=fused_moe,
        store_latent=store_latent,
        latent_attention=mla_ref.latent_attention_via(paged_attention),
        apply_rotary=rotary_ref.apply_rotary,
    )


class _PoolView:
    """The pool's layers, as the model reads them, from its tensor given to the compiled graph as
    an input (so the KV writes mutate that input in place)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        return layer_planes(self.kv, index)


def bucket(num_tokens: int, largest: int) -> int:
    """The padded token count: the next power of two (at most `largest`, past which it is
    `num_tokens` itself)."""
    size = 1
    while size < num_tokens:
        size *= 2
    return size if size <= largest else num_tokens


def compile_unavailable(device: str) -> str | None:
    """Why compiling cannot work here, or None."""
    if (
        not device.startswith("cuda")
        and shutil.which("g++") is None
        and shutil.which("c++") is None
    ):
        return "no C++ compiler (g++) for torch.compile on CPU"
    return None


class CompiledStep:
    """The model's forward over padded inputs, compiled once for dynamic shapes."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, ops: Ops, max_tokens: int) -> None:
        self.model = model
        self.pool = pool
        self.ops = _opaque_ops(ops)
        self.max_tokens = max_tokens
        self.compile_s = 0.0
        self._eager_ops = ops
        # The first line of the error that made the step run eagerly from then on; None while
        # every step so far ran compiled.
        self.failure: str | None = None
        self._warming = False
        # One graph per bucket (and per bucket, one for a single sequence): room for them all,
        # added to the room earlier steps took. Dynamo counts graphs per code object, and every
        # step's `_forward` is the same code, so a process's second or third engine (a test's,
        # a draft model's) otherwise hit the limit, and fullgraph made that a failure.
        config = torch._dynamo.config
        buckets = max(1, self.max_tokens).bit_length() + 1
        config.recompile_limit += 2 * buckets + 4
        config.accumulated_recompile_limit = max(
            config.accumulated_recompile_limit, config.recompile_limit
        )
        # Static token counts (one graph per bucket: inductor's dynamic token dimension gave wrong
        # results here), dynamic sequence counts and block-table widths (the attention op's only).
        self._fn = torch.compile(self._forward, dynamic=None, fullgraph=True)

    def _forward(self, ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, kv):
        batch = AttentionBatch(slot_mapping, block_tables, seq_lens, query_start_loc, 0)
        return self.model(ids, positions, batch, _PoolView(kv), self.ops)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch):
        n = ids.shape[0]
        pad = bucket(n, self.max_tokens) - n
        slots = batch.slot_mapping
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
            slots = torch.nn.functional.pad(slots, (0, pad), value=-1)
        for tensor, dims in (
            (batch.block_tables, (0, 1)),
            (batch.seq_lens, (0,)),
            (batch.query_start_loc, (0,)),
        ):
            for dim in dims:
                torch._dynamo.mark_dynamic(tensor, dim)
        for tensor in (ids, positions, slots):
            torch._dynamo.mark_static(tensor, 0)
        # The pool's shape is static too: a second engine in one process (another model or
        # block size) made dynamo's automatic dynamic shapes treat the pool's dimensions as
        # symbolic, and inductor's graphs over a symbolic pool gave wrong tokens.
        for dim in range(self.pool.kv.dim()):
            torch._dynamo.mark_static(self.pool.kv, dim)
        if self.failure is not None:
            return self.model(ids[:n], positions[:n], batch, self.pool, self._eager_ops)
        try:
            hidden = self._fn(
                ids,
                positions,
                slots,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                self.pool.kv,
            )
        except Exception as exc:  # noqa: BLE001 - a shape that does not compile: run eagerly
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            self.failure = f"{type(exc).__name__}: {first}"
            if self._warming:
                raise
            logger.warning("compile: failed for %d tokens (%s); steps run eagerly", n, self.failure)
            return self.model(ids[:n], positions[:n], batch, self.pool, self._eager_ops)
        return hidden[:n]

    @property
    def runs_compiled(self) -> bool:
        """Whether steps run the compiled graphs (False once a shape failed to compile)."""
        return self.failure is None

    def warm_up(self, device: torch.device) -> float:
        """Compile now (one decode step of two sequences and one of one, writing nowhere):
        returns the seconds it took. A failure to compile raises here, so that the node says so
        and runs eagerly rather than claim a compiled step."""
        start = time.perf_counter()
        self._warming = True
        try:
            self._warm_up_buckets(device)
        finally:
            self._warming = False
        self.compile_s = time.perf_counter() - start
        return self.compile_s

    def _warm_up_buckets(self, device: torch.device) -> None:
        for num_seqs in (2, 1, 3):
            ids = torch.zeros(num_seqs, dtype=torch.int64, device=device)
            batch = AttentionBatch(
                slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64, device=device),
                block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=device),
                seq_lens=torch.ones(num_seqs, dtype=torch.int64, device=device),
                query_start_loc=torch.arange(num_seqs + 1, device=device),
                max_query_len=1,
            )
            with torch.inference_mode():
                self(ids, ids.clone(), batch)
