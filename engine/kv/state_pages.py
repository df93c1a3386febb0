"""A linear-attention layer's state kept in the paged KV pool: the short causal convolution's
window and the recurrent matrix of each value head, written into the layer's page of a block.

A linear layer (Gated DeltaNet) takes a slot of the pool like an attention layer; its page of a
block is [planes, block_size, heads, head_dim] like theirs. Of a sequence's blocks, the one that
holds position p holds the layer's state after token p (`LinearState`): a block left behind
holds the state at its end, a snapshot that the prefix cache keeps, the tiers copy and a handoff
sends, all as pages. The state must fit one page, so the block size has a floor
(`min_block_size`), as vLLM's hybrid models raise theirs.

The state is laid by the pool's KV heads: a pool head's part of the page holds the state of the
linear heads it stands for (num_v_heads / num_kv_heads value heads and num_k_heads /
num_kv_heads key heads, consecutive), so that cutting pages by heads cuts states by heads: a
tensor-parallel rank's pool holds its heads' states, and a handoff between nodes of unequal
tensor-parallel sizes re-splits them as it re-splits attention pages. Within a head's part:
the recurrent matrices [value heads, key dim, value dim], then the convolution windows of its
query, key and value channels [channels, kernel - 1], as transformers' in_proj_qkv orders them
(all q, all k, all v), then padding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LinearStateShape:
    """One rank's view of a linear layer's state, and the pool heads it is laid over."""

    pool_heads: int  # the pool's KV heads on this rank
    head_dim: int  # the pool's head_dim
    planes: int  # the pool's planes (2: K and V)
    num_k_heads: int  # this rank's linear key heads
    num_v_heads: int  # this rank's linear value heads
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp_size: int = 1) -> LinearStateShape:
        """A rank's shape of a hybrid model's linear layers' states, of tp_size ranks that
        split the attention KV heads and the linear heads alike."""
        linear = cfg.linear_attention
        if linear is None:
            raise ValueError(f"{cfg.model_type} has no linear-attention layers")
        for what, count in (
            ("attention KV heads", cfg.num_kv_heads),
            ("linear key heads", linear.num_k_heads),
            ("linear value heads", linear.num_v_heads),
        ):
            if count % tp_size:
                raise ValueError(
                    f"tensor_parallel_size {tp_size} does not divide {cfg.model_type}'s "
                    f"{count} {what}"
                )
        return cls(
            cfg.num_kv_heads // tp_size,
            cfg.head_dim,
            2,
            linear.num_k_heads // tp_size,
            linear.num_v_heads // tp_size,
            linear.head_k_dim,
            linear.head_v_dim,
            linear.conv_kernel,
        )

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads"):
            if getattr(self, name) % self.pool_heads:
                raise ValueError(
                    f"linear attention's {getattr(self, name)} {name[4:]} do not divide over "
                    f"the pool's {self.pool_heads} KV heads"
                )

    @property
    def k_per_head(self) -> int:
        return self.num_k_heads // self.pool_heads

    @property
    def v_per_head(self) -> int:
        return self.num_v_heads // self.pool_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (key heads x key dim each), then v."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def per_head(self) -> int:
        """Elements of one pool head's part of the state."""
        width = self.conv_kernel - 1
        recurrent = self.v_per_head * self.head_k_dim * self.head_v_dim
        conv = (2 * self.k_per_head * self.head_k_dim + self.v_per_head * self.head_v_dim) * width
        return recurrent + conv

    def min_block_size(self) -> int:
        """The fewest tokens per block whose page holds the state."""
        per_token = self.planes * self.head_dim
        return -(-self.per_head // per_token)

    def read(
        self, planes: tuple[torch.Tensor, ...], blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states in these blocks' pages of a layer (planes: its pages, each [num_blocks,
        block_size, heads, head_dim]): (conv [n, conv_dim, kernel - 1], recurrent [n, value
        heads, key dim, value dim]), copies in the pool's dtype."""
        n = blocks.shape[0]
        flat = torch.cat(
            [p[blocks].transpose(1, 2).reshape(n, self.pool_heads, -1) for p in planes], -1
        )
        flat = flat[..., : self.per_head]
        width = self.conv_kernel - 1
        a, c = self.k_per_head, self.v_per_head
        sizes = [
            c * self.head_k_dim * self.head_v_dim,
            a * self.head_k_dim * width,
            a * self.head_k_dim * width,
            c * self.head_v_dim * width,
        ]
        recurrent, q, k, v = flat.split(sizes, dim=-1)
        recurrent = recurrent.reshape(n, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        conv = torch.cat(
            [
                q.reshape(n, -1, width),
                k.reshape(n, -1, width),
                v.reshape(n, -1, width),
            ],
            dim=1,
        )
        return conv, recurrent

    def write(
        self,
        planes: tuple[torch.Tensor, ...],
        blocks: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
    ) -> None:
        """Store states into these blocks' pages (distinct blocks; conv and recurrent as `read`
        returns them, any float dtype)."""
        n = blocks.shape[0]
        if n == 0:
            return
        heads = self.pool_heads
        key_channels = self.num_k_heads * self.head_k_dim
        q, k, v = conv.split([key_channels, key_channels, self.num_v_heads * self.head_v_dim], 1)
        parts = [
            recurrent.reshape(n, heads, -1),
            q.reshape(n, heads, -1),
            k.reshape(n, heads, -1),
            v.reshape(n, heads, -1),
        ]
        page = planes[0].shape[1] * self.head_dim  # one plane's elements per head
        dtype = planes[0].dtype
        flat = torch.zeros(n, heads, len(planes) * page, dtype=dtype, device=planes[0].device)
        flat[..., : self.per_head] = torch.cat([part.to(dtype) for part in parts], -1)
        block_size = planes[0].shape[1]
        for index, plane in enumerate(planes):
            chunk = flat[..., index * page : (index + 1) * page]
            pages = chunk.reshape(n, heads, block_size, self.head_dim).transpose(1, 2)
            plane.index_copy_(0, blocks, pages.contiguous())


def fitted_block_size(cfg: ModelConfig, requested: int) -> int:
    """The block size a model's pool uses: the requested one if its pages hold a linear layer's
    state (or the model has none), else the requested one's smallest multiple that does. It is
    the same at every tensor-parallel size (a rank's state and page shrink alike), so prefill
    and decode nodes of any sizes agree on it."""
    if cfg.linear_attention is None:
        return requested
    minimum = LinearStateShape.for_model(cfg).min_block_size()
    return requested * -(-minimum // requested)
