"""One rank's share of a node: its part of the model on its device, the KV pool of its heads and
the runner over them. Rank 0 of every node builds one (with one rank, the whole model); every
other tensor-parallel rank builds its own in its process, alike, so the ranks agree on the pool's
size and capture the same CUDA graphs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import linear as cpu_linear
from pdserve.engine.execution.decode_rows import graph_query_len
from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.models.loader import load_model
from pdserve.engine.quant.experts import QuantExperts
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.mxfp4_experts import Mxfp4Experts
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.kv_fp8_ref import fp8_cache_ops
from pdserve.kernels.ops import select_ops

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30

PoolFactory = Callable[[KVLayout, int], KVPool]


class ModelShard:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        shard: TPShard,
        group: TPGroup | None = None,
        pool_factory: PoolFactory | None = None,
        shared_bytes_per_block: int = 0,
        reserved_bytes: int = 0,
    ) -> None:
        """pool_factory(layout, num_blocks) makes the KV pool of this rank's heads (e.g. a KV
        receiver's, in shared memory); by default a plain tensor on the device.
        shared_bytes_per_block: another pool of as many blocks takes this many bytes per block
        out of the same budget (a draft model's, on rank 0). reserved_bytes: another pool of a
        size of its own takes this many bytes of the budget first (a draft model's, sized by
        its draft_num_kv_blocks). Neither applies where config.num_kv_blocks is given."""
        self.shared_bytes_per_block = shared_bytes_per_block
        self.reserved_bytes = reserved_bytes
        self.config = config
        self.shard = shard
        self.group = group
        self.device = config.rank_device(shard.rank)
        dtype = config.resolved_dtype()
        self.model = load_model(model_dir, dtype, self.device, shard, group)
        if shard.is_first:
            logger.info("%s", weight_line(self.model))
        if cpu_linear.choose(config.cpu_linear, self.device, dtype, config.compile):
            n = cpu_linear.pack(self.model)
            logger.info("cpu_linear: %d linear layers packed for oneDNN", n)
        mcfg = self.model.config
        self.layout = KVLayout.for_model(
            mcfg,
            config.block_size,
            config.kv_dtype(),
            len(shard.kv_heads(mcfg.cache_heads)),
            heads_of=lambda heads: len(shard.kv_heads(heads)),
        )
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget()
        if group is not None:
            num_blocks = group.min(num_blocks)  # every rank's pool holds the same blocks
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {self.layout}")
        self.num_blocks = num_blocks
        if shard.is_first:
            logger.info("%s", kv_capacity_line(self.layout, num_blocks))
        if pool_factory is None:
            self.pool = KVPool(self.layout, num_blocks, self.device)
        else:
            self.pool = pool_factory(self.layout, num_blocks)
        self.ops = select_ops(self.device, config.kernel_backend)
        if self.layout.is_fp8:
            self.ops = fp8_cache_ops(self.ops)
        self.runner = ModelRunner(self.model, self.pool, self.ops, self.device)
        if config.compile:
            self._compile()

    @property
    def context_limit(self) -> int:
        return self.config.context_limit(self.model.config.max_position_embeddings, self.num_blocks)

    def _num_blocks_from_budget(self) -> int:
        """This rank's share of the node's budget: a fraction of its GPU's free memory, or of the
        node's CPU budget."""
        if self.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = (self.config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES) // self.shard.size
        if self.reserved_bytes:
            if budget - self.reserved_bytes < self.layout.bytes_per_block:
                raise ValueError(
                    f"the KV budget of {budget} bytes leaves no block of {self.layout} once "
                    f"{self.reserved_bytes} bytes are taken for the draft model's pool "
                    "(speculative_config draft_num_kv_blocks)"
                )
            budget -= self.reserved_bytes
        return max(0, budget // (self.layout.bytes_per_block + self.shared_bytes_per_block))

    def _compile(self) -> None:
        """Compile the model step, or say in one line why it runs eagerly."""
        from pdserve.engine.execution.compiled_step import CompiledStep, compile_unavailable

        why = compile_unavailable(self.device)
        if why is None and self.device.startswith("cuda"):
            why = "compiled steps run on CPU nodes only (CUDA nodes have CUDA graphs)"
        if why is None and self.shard.size > 1:
            why = "compiled steps run without tensor parallelism only"
        if why is None and len(self.pool.layout.groups.groups) > 1:
            why = "compiled steps take models of one KV group only (this one mixes layer kinds)"
        if why is None:
            why = self.model.eager_only
        if why is not None:
            logger.warning("compile: %s; the model step runs eagerly", why)
            return
        step = CompiledStep(self.model, self.pool, self.ops, self.config.max_num_batched_tokens)
        try:
            seconds = step.warm_up(torch.device(self.device))
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eagerly
            why = step.failure or f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            logger.warning("compile: failed at warm-up (%s); the model step runs eagerly", why)
            return
        self.runner.compiled = step
        logger.info(
            "compile: model step compiled in %.1f s (small decode buckets; larger token counts "
            "compile on first use)",
            seconds,
        )

    def uses_cuda_graphs(self) -> bool:
        """Graphs need CUDA and kernels free of host syncs: the Triton ones, not the reference
        (which reads sequence lengths on the host to group its gathers)."""
        if self.config.enforce_eager or not self.device.startswith("cuda"):
            return False
        if self.ops.name != "triton":
            logger.info("decode steps run eagerly: CUDA graphs need the triton kernel backend")
            return False
        if self.model.eager_only is not None:
            logger.info("decode steps run eagerly: %s", self.model.eager_only)
            return False
        return True

    def add_layer_hook(self, hook) -> None:  # noqa: ANN001
        """hook(layer) once each layer's K/V of an eager prefill step is in this rank's pool
        (`ModelRunner.layer_hooks`): how a rank streams its pages layer by layer."""
        self.runner.add_layer_hook(hook)

    def capture_decode_graphs(self) -> None:
        """Capture when this rank can (every rank of a group decides alike)."""
        if self.uses_cuda_graphs():
            config = self.config
            speculation = config.speculation()
            drafts = speculation.num_speculative_tokens if speculation is not None else 0
            self.runner.capture_decode_graphs(
                min(config.cuda_graph_max_batch_size, config.max_num_seqs),
                self.context_limit,
                graph_query_len(drafts, config.forced_tokens),
                config.max_num_batched_tokens,
            )


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes this rank's weights take, as stored (a tied weight once): what leaves the rest
    of a GPU's memory to the KV pool."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_line(model: torch.nn.Module) -> str:
    """The start-up log's weights: their bytes on this rank, and the quantized layers' share."""
    total = weight_bytes(model)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    experts = [m for m in model.modules() if isinstance(m, QuantExperts | Mxfp4Experts)]
    line = f"weights: {total / 2**20:.1f} MiB on this rank"
    if quantized or experts:
        packed = sum(weight_bytes(m) for m in quantized + experts)
        held = [f"{len(quantized)} linear layers"] if quantized else []
        held += [f"{len(experts)} layers' experts"] if experts else []
        where = " and ".join(held)
        scheme = model.config.quantization
        line += (
            f", of which {packed / 2**20:.1f} MiB in {where} kept in "
            f"{scheme.label} (weights and their scales; {_how_quantized_run(model)})"
        )
    return line


def _how_quantized_run(model: torch.nn.Module) -> str:
    """What a quantized layer does with its weights on the device the model is on."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return "dequantized per call"
    return "read as stored by Triton kernels where the GPU runs them, else dequantized per call"


def kv_capacity_line(layout: KVLayout, num_blocks: int) -> str:
    """The start-up log's KV capacity: blocks, tokens, and what one token costs per layer."""
    tokens = num_blocks * layout.block_size
    per_token = layout.bytes_per_block // layout.block_size
    if layout.planes == 1:
        what = f"a latent of {layout.head_dim} per layer"
    else:
        what = f"K and V of {layout.num_kv_heads} heads x {layout.head_dim} per layer"
    if layout.is_fp8:
        what += ", each row with its float32 scale"
    if not layout.layer_kinds:
        return (
            f"KV cache: {num_blocks} blocks of {layout.block_size} = {tokens} tokens, "
            f"{per_token} bytes per token ({what}, {layout.dtype})"
        )
    groups = layout.groups.groups
    kinds: dict[str, int] = {}
    for group in groups:
        kinds[group.kind.label] = kinds.get(group.kind.label, 0) + len(group.layers)
    full = sum(1 for g in groups if g.kind.reach is None)
    if layout.layer_shapes:
        return (
            f"KV cache: {num_blocks} blocks of {layout.block_size} shared by {len(groups)} KV "
            f"groups of layers of unequal page shapes ("
            + ", ".join(f"{label}: {n} layers" for label, n in kinds.items())
            + f"), {layout.bytes_per_block} bytes a block ({layout.num_slots} slots of "
            f"{layout.num_kv_heads} heads x {layout.head_dim}, smaller pages in lanes, "
            f"{layout.dtype}); {page_fill_line(layout)}"
        )
    return (
        f"KV cache: {num_blocks} blocks of {layout.block_size} shared by {len(groups)} KV groups "
        f"of {layout.num_slots} layers each at most ("
        + ", ".join(f"{label}: {n} layers" for label, n in kinds.items())
        + f"), {layout.bytes_per_block} bytes a block ({what}, {layout.dtype}); a prompt "
        f"token costs {full * per_token} bytes in the full-attention groups, each other group "
        "holds its window's or chunk's last tokens only"
    )


def page_fill_line(layout: KVLayout) -> str:
    """How much of a block's bytes each group's pages use (the rest idle), where layers' pages
    differ in shape: the full-attention groups' share is what a long context pays."""
    groups = layout.groups
    full = [g for g in range(groups.num_groups) if groups.groups[g].kind.reach is None]
    windowed = [g for g in range(groups.num_groups) if g not in full]

    def share(indices: list[int]) -> str:
        return "/".join(f"{groups.fill(g):.0%}" for g in indices) or "none"

    return (
        f"a block's bytes used: {share(full)} in the full-attention groups, {share(windowed)} "
        "in the others"
    )
