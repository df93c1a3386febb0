"""A linear layer whose weight stays in GPTQ's layout in memory (4- or 8-bit values packed
along the inputs into int32 words, zero points packed along the outputs, float16 scales per
group, each input's group in `g_idx`) and is dequantized into the activations' dtype on every
call; on a GPU with the W4A16 kernel a 4-bit layer is rewritten into its layout once loaded
(`w4a16_layout.gptq_operands`: act-order's inputs sorted by group). Fused projections (q/k/v, gate/up) hold their parts side by side along the outputs, each
with its own `g_idx` row (act-order gives each checkpoint projection its own).

A row-parallel rank (o_proj, down_proj) holds its inputs' packed rows and `g_idx` entries; with
act-order (`desc_act`) or one group for all inputs its inputs may belong to any group, so it
holds every group's zero points and scales, as vLLM does; otherwise only its own groups'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.quant import w4a16_layout
from pdserve.engine.quant.gptq_reference import stored_zeros
from pdserve.engine.quant.int_packing import per_word, unpack
from pdserve.engine.quant.packed_linear import PackedLinear, word_range, words

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor
    from pdserve.engine.quant.linear import RankGroup


class GptqLinear(PackedLinear):
    kinds = ("qweight", "qzeros", "scales", "g_idx")
    format_name = "GPTQ"

    def __init__(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        bits: int,
        group_size: int,
        desc_act: bool,
        v1: bool,
        group: RankGroup | None = None,
    ) -> None:
        """out_parts: the output rows of each fused projection in order (one part: unfused).
        group_size -1: one group for all inputs. v1: zero points stored minus one. With a group
        the layer is row-parallel: its input is this rank's share, its outputs summed."""
        super().__init__()
        self.in_features = in_features
        self.out_parts = out_parts
        self.out_features = sum(out_parts)
        self.bits, self.group_size, self.v1 = bits, group_size, v1
        self.group = group
        self.per_word = per_word(bits)
        for n in out_parts:
            words(n, self.per_word, "a GPTQ projection's output rows")
        # Whether this rank's inputs may fall in any group: then it holds them all.
        self.all_groups = group is not None and (desc_act or group_size == -1)
        self.num_groups = self._groups(in_features * (group.size if self.all_groups else 1))
        self._hold("qweight", (words(in_features, self.per_word, "inputs"), self.out_features))
        self._hold("qzeros", (self.num_groups, self.out_features // self.per_word))
        self._hold("scales", (self.num_groups, self.out_features))
        self._hold("g_idx", (len(out_parts), in_features))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features)) if bias else None

    def _groups(self, inputs: int) -> int:
        return 1 if self.group_size == -1 else -(-inputs // self.group_size)

    @property
    def kernel_group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    def published_to_kernel(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        g, k = self.kernel_group, self.in_features
        if self.bits != 4:
            raise ValueError(f"GPTQ bits {self.bits}: the W4A16 kernel reads 4-bit weights")
        if not w4a16_layout.kernel_reads(g, k):
            raise ValueError(f"GPTQ group_size {g} is not a multiple of 16")
        if self.num_groups != -(-k // g):
            raise ValueError("this rank's act-order inputs fall in every group, not in runs")
        return w4a16_layout.gptq_operands(
            self.qweight, self.qzeros, self.scales, self.g_idx, self.out_parts, g, self.v1
        )

    def published_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (as `gptq_reference.dequantize`, computed in
        float32): each value minus its group's zero point, times its group's scale, each fused
        part's inputs grouped by its own `g_idx`."""
        # Small integers are exact in float32, where the arithmetic is faster than in int32.
        q = unpack(self.qweight, self.bits, 0).float()  # [in, out]
        zeros = stored_zeros(self.qzeros, self.bits, self.v1).float()
        scales = self.scales.float()
        n_in, g = self.in_features, self.group_size
        # Inputs in order, whole groups (no act-order): broadcast each group's zero and scale
        # over its inputs instead of gathering them per input.
        ordered = g > 0 and n_in % g == 0 and len(scales) == n_in // g
        in_order = torch.arange(n_in, device=q.device) // g if ordered else None
        parts, start = [], 0
        for i, n in enumerate(self.out_parts):
            cols = slice(start, start + n)
            if ordered and torch.equal(self.g_idx[i], in_order.to(torch.int32)):
                w = (q[:, cols].reshape(-1, g, n) - zeros[:, None, cols]) * scales[:, None, cols]
                parts.append(w.reshape(n_in, n))
            else:
                groups = self.g_idx[i].long()
                parts.append((q[:, cols] - zeros[groups, cols]) * scales[groups, cols])
            start += n
        w = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return w.T.to(dtype)

    def load(
        self, kind: str, tensor: CheckpointTensor, dim: int, part: range, size: int, offset: int
    ) -> None:
        """Read this rank's `part` (of `size`, along `dim`: 0 output rows, 1 inputs) of a
        projection's `qweight`, `qzeros`, `scales` or `g_idx`; a fused part's outputs go at
        `offset`."""
        self._published()
        k = self.per_word
        out, n = (size, self.in_features) if dim == 0 else (self.out_features, size)
        groups = self._groups(n)
        full = {
            "qweight": (words(n, k, "inputs"), out),
            "qzeros": (groups, words(out, k, "output rows")),
            "scales": (groups, out),
            "g_idx": (n,),
        }[kind]
        target = getattr(self, kind).data
        with torch.no_grad():
            if kind == "g_idx":
                held = range(groups) if dim == 0 else self._group_rows(part, groups)
                rows = None if dim == 0 else part
                g_idx = self._read(kind, tensor, full, rows=rows) - held.start
                if g_idx.min() < 0 or g_idx.max() >= len(held):
                    raise ValueError(
                        f"weight '{tensor.name}' puts inputs {part.start}..{part.stop} in groups "
                        f"{int(g_idx.min()) + held.start}..{int(g_idx.max()) + held.start}, "
                        f"outside the groups {held.start}..{held.stop - 1} they are read with "
                        "(a shuffled g_idx needs quantization_config.desc_act = true)"
                    )
                target[self._part_at(offset) if dim == 0 else 0].copy_(g_idx)
            elif dim == 0:
                cols = word_range(part, k) if kind == "qzeros" else part
                start = offset // k if kind == "qzeros" else offset
                target.narrow(1, start, len(cols)).copy_(
                    self._read(kind, tensor, full, columns=cols)
                )
            else:
                rows = word_range(part, k) if kind == "qweight" else self._group_rows(part, groups)
                target.copy_(self._read(kind, tensor, full, rows=rows))

    def _group_rows(self, part: range, groups: int) -> range:
        """The groups (zero-point and scale rows) held for the inputs `part` of a projection
        whose inputs fall in `groups` groups."""
        if self.all_groups or self.group_size == -1:
            return range(groups)
        g = self.group_size
        return range(part.start // g, -(-part.stop // g))
