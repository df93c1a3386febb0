"""Which part of a model one tensor-parallel rank owns: its attention heads, its KV heads, its
columns of the MLP (of every expert's, in a mixture of experts) and its rows of the vocabulary. Pure arithmetic, the same on every rank.

Query heads and MLP columns split evenly. KV heads split evenly when there are at least as many
as ranks; with fewer, each KV head is replicated on size / num_kv_heads consecutive ranks, so
every rank's query heads still find their KV head locally. The vocabulary splits into
ceil(vocab / size) rows per rank, the last rank's part shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a tensor-parallel group of {self.size}")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the config field that this group size cannot split."""
        size = self.size
        fields = [("num_attention_heads", cfg.num_heads)]
        # A dense MLP somewhere (Gemma 4's layers have one beside their experts).
        if len(cfg.sparse_layers) < cfg.num_layers or cfg.gemma4 is not None:
            dense = "intermediate_size_mlp" if cfg.llama4 else "intermediate_size"  # Llama 4's
            fields.append((dense, cfg.intermediate_size))
        if cfg.is_moe:
            # Their experts' width is `intermediate_size`.
            per_expert = cfg.model_type in ("mixtral", "gpt_oss", "llama4_text")
            name = "intermediate_size" if per_expert else "moe_intermediate_size"
            fields.append((name, cfg.moe_intermediate_size))
        if cfg.shared_expert_intermediate_size:
            fields.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
        for field, value in fields:
            if value % size:
                raise ValueError(
                    f"config.json field '{field}' = {value} is not divisible by "
                    f"tensor_parallel_size={size}"
                )
        if cfg.linear_attention is not None:
            self._check_linear(cfg)
        if cfg.quantization is not None and size > 1:
            self._check_blocks(cfg)
        kv = cfg.cache_heads  # MLA's one latent is whole on every rank
        if (kv >= size and kv % size) or (kv < size and size % kv):
            raise ValueError(
                f"config.json field 'num_key_value_heads' = {kv} and tensor_parallel_size="
                f"{size}: one must divide the other"
            )
        for kv in sorted(set(cfg.layer_kv_heads)):  # layers whose KV shapes differ (Gemma 4)
            if kv % size:
                raise ValueError(
                    f"layers of {kv} KV heads (num_global_key_value_heads or per_layer_config) "
                    f"and tensor_parallel_size={size}: the ranks must split every layer's KV "
                    "heads (replicating some layers' heads would change the pages' relative "
                    "sizes, which the KV pool's lanes rely on)"
                )

    def _check_linear(self, cfg: ModelConfig) -> None:
        """A hybrid's linear layers split their key and value heads evenly, and its attention
        layers their KV heads: a rank's linear states are laid over its pool heads, so those
        cannot be replicated."""
        linear, size = cfg.linear_attention, self.size
        for field, value in (
            ("linear_num_key_heads", linear.num_k_heads),
            ("linear_num_value_heads", linear.num_v_heads),
            ("num_key_value_heads", cfg.num_kv_heads),
        ):
            if value % size:
                raise ValueError(
                    f"config.json field '{field}' = {value} is not divisible by "
                    f"tensor_parallel_size={size} (a linear-attention model's ranks split its "
                    "linear heads and KV heads, none replicated)"
                )

    def _check_blocks(self, cfg: ModelConfig) -> None:
        """Every rank's share of a block-quantized projection starts on a block boundary, so
        the quantized weight and its scales split along the same lines."""
        block = cfg.quantization.alignment
        hd = cfg.head_dim
        ranks = [TPShard(r, self.size) for r in range(self.size)]
        q = [
            range(s.q_heads(cfg.num_heads).start * hd, s.q_heads(cfg.num_heads).stop * hd)
            for s in ranks
        ]
        kv = [kv_head_range(s.rank, s.size, cfg.num_kv_heads) for s in ranks]
        kv = [range(r.start * hd, r.stop * hd) for r in kv]
        mlp = [s.columns(cfg.intermediate_size) for s in ranks]
        # (what, the module in layer 0's names, axis, each rank's share, the block along it)
        splits = [
            ("q_proj", "self_attn.q_proj", "rows", q, block[0]),
            ("k_proj and v_proj", "self_attn.k_proj", "rows", kv, block[0]),
            ("o_proj", "self_attn.o_proj", "columns", q, block[1]),
            ("gate_proj and up_proj", "mlp.gate_proj", "rows", mlp, block[0]),
            ("down_proj", "mlp.down_proj", "columns", mlp, block[1]),
        ]
        for what, module, axis, parts, size in splits:
            if not cfg.quantization.quantizes(f"model.layers.0.{module}"):
                continue  # kept float: any split
            for rank, part in enumerate(parts):
                if part.start % size:
                    raise ValueError(
                        f"quantization_config ({cfg.quantization.label}) and "
                        f"tensor_parallel_size={self.size}: rank {rank}'s {axis} of {what} "
                        f"start at {part.start}, inside a block of {size} (each rank's share "
                        "must be whole blocks, groups or packed words)"
                    )

    def q_heads(self, num_heads: int) -> range:
        per = num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> range:
        """This rank's KV heads: a slice of them, or the one head it shares with
        size / num_kv_heads ranks."""
        return kv_head_range(self.rank, self.size, num_kv_heads)

    def columns(self, n: int) -> range:
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab_size: int) -> range:
        per = self.vocab_rows_per_rank(vocab_size)
        return range(min(vocab_size, self.rank * per), min(vocab_size, (self.rank + 1) * per))

    def vocab_rows_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> range:
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


def kv_head_ranges(size: int, num_kv_heads: int) -> list[range]:
    """Every rank's KV heads, by rank: what a node's KV layout handshake carries."""
    return [kv_head_range(r, size, num_kv_heads) for r in range(size)]
