"""Linear layers whose compressed-tensors weight stays quantized in memory and is dequantized into
the activations' dtype on every call: `ScaledInt8Fp8Linear` (an int8 or float8_e4m3fn `weight`
and its scales: FP8 and INT8 W8A8 checkpoints) and `PackedInt4Linear` (the int32 `weight_packed`
words of 4-bit values, their group scales and zero points: W4A16 `pack-quantized`).

Scales are kept per output row, float32 [out, groups] (one group for tensor and channel
strategies; a tensor scale is repeated on its part's rows, so fused q/k/v or gate/up parts keep
their own), and 4-bit zero points unpacked, int8 [out, groups]: both tiny beside the weight, and
a fused part or a rank's share then starts on any row."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pdserve.engine.quant.compressed_tensors_reference import (
    FP8,
    INT4_OFFSET,
    PER_WORD,
    unpack_int4,
)
from pdserve.engine.quant.gemm_choice import w4a16_gemm_on
from pdserve.engine.quant.linear import QuantLinear

if TYPE_CHECKING:  # the models import these layers; they only read what they hand them
    from pdserve.engine.models.weights import CheckpointTensor
    from pdserve.engine.quant.linear import RankGroup

STORED = {"fp8": ("F8_E4M3", FP8), "int8": ("I8", torch.int8)}


def _words(n: int) -> int:
    return -(-n // PER_WORD)


class WeightScheme(Protocol):
    """What a layer reads of its `compressed_tensors_scheme.CompressedTensorsScheme` (which builds
    these layers, so is not imported here): the stored kind (`fp8`, `int8`, `int4`), whether its
    weights are symmetric, and their scales' strategy and group size."""

    kind: str
    symmetric: bool
    strategy: str
    group_size: int | None


class _CompressedTensorsLinear(QuantLinear):
    """What both layers share: the per-row scales, the logical shapes, the moves that keep the
    stored dtypes, and reading the scales, `weight_shape` and `input_scale`."""

    packed_names: tuple[str, ...] = ()

    def __init__(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        scheme: WeightScheme,
        group: RankGroup | None,
    ) -> None:
        """out_parts: the output rows of each fused projection in order (one part: unfused).
        With a group the layer is row-parallel: its input is this rank's share, its partial
        outputs are summed across ranks and the whole bias added once."""
        super().__init__()
        self.in_features = in_features
        self.out_parts = out_parts
        self.out_features = sum(out_parts)
        self.scheme = scheme
        self.group = group
        self.group_size = scheme.group_size or in_features
        if in_features % self.group_size:
            raise ValueError(
                f"a projection of {in_features} input columns (on this rank) is not whole groups "
                f"of quantization_config group_size {self.group_size}"
            )
        self.weight_scale = nn.Parameter(
            torch.empty(self.out_features, in_features // self.group_size), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: ANN202
        """Moves (and `to_empty`) reach the quantized weight, scales and zero points; dtype
        casts of the model (`model.to(torch.bfloat16)`) do not: they keep their stored dtypes."""
        device = fn(torch.empty(0, device=self.weight_scale.device)).device
        for name in (*self.packed_names, "weight_scale"):
            param = getattr(self, name)
            moved = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.detach()), requires_grad=False)
        return self

    def _full(self, dim: int, size: int) -> tuple[int, int]:
        """The checkpoint projection's logical [out, in] (this layer's part `dim` is `size`)."""
        return (size, self.in_features) if dim == 0 else (self.out_features, size)

    def load(
        self, kind: str, tensor: CheckpointTensor, dim: int, part: range, size: int, offset: int
    ) -> None:
        full = self._full(dim, size)
        if kind == "weight_shape":
            shape = tuple(int(v) for v in tensor.read(dtype=torch.int64).reshape(-1))
            if shape != full:
                raise ValueError(f"weight '{tensor.name}' says {shape}, expected {full}")
        elif kind == "input_scale":  # a static activation scale: read, not applied
            if tensor.shape not in ((), (1,)):
                raise ValueError(f"weight '{tensor.name}' has shape {tensor.shape}, expected (1,)")
        elif kind == "weight_scale":
            with torch.no_grad():
                self._load_scale(tensor, dim, part, full, offset)
        else:
            with torch.no_grad():
                self._load_packed(kind, tensor, dim, part, full, offset)

    def _load_scale(
        self, tensor: CheckpointTensor, dim: int, part: range, full: tuple[int, int], offset: int
    ) -> None:
        strategy, target = self.scheme.strategy, self.weight_scale.data
        rows = target.narrow(0, offset, len(part)) if dim == 0 else target
        if strategy == "tensor":
            _check(tensor, ((), (1,)), "one scale for the tensor")
            rows.fill_(float(tensor.read_slices(dtype=torch.float32).reshape(-1)[0]))  # [1] or ()
            return
        groups = 1 if strategy == "channel" else full[1] // self.group_size
        _check(tensor, ((full[0], groups),), f"{strategy} scales")
        if dim == 0:
            rows.copy_(tensor.read(rows=part, dtype=torch.float32))
        elif strategy == "channel":
            rows.copy_(tensor.read(dtype=torch.float32))
        else:
            cols = range(part.start // self.group_size, part.stop // self.group_size)
            rows.copy_(tensor.read(columns=cols, dtype=torch.float32))

    def _load_packed(
        self,
        kind: str,
        tensor: CheckpointTensor,
        dim: int,
        part: range,
        full: tuple[int, int],
        offset: int,
    ) -> None:
        raise NotImplementedError

    def _scaled(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """values [out, in] (float32, zero points taken off) times their group's scale."""
        out, cols = values.shape
        groups = self.weight_scale.shape[1]
        scaled = values.view(out, groups, cols // groups) * self.weight_scale[:, :, None]
        return scaled.view(out, cols).to(dtype)


def _check(tensor: CheckpointTensor, shapes: tuple[tuple[int, ...], ...], what: str) -> None:
    if tuple(tensor.shape) not in shapes:
        raise ValueError(
            f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected "
            f"{' or '.join(str(s) for s in shapes)} ({what})"
        )


class ScaledInt8Fp8Linear(_CompressedTensorsLinear):
    """An int8 (W8A8) or float8_e4m3fn (FP8) `weight` [out, in] and its per-tensor or
    per-channel `weight_scale`; a static FP8 checkpoint's `input_scale` is read and dropped."""

    packed_names = ("weight",)

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.stored, dtype = STORED[self.scheme.kind]
        self.kinds = ("weight", "weight_scale", "input_scale")
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=dtype), requires_grad=False
        )

    def _load_packed(self, kind, tensor, dim, part, full, offset) -> None:  # noqa: ANN001
        _check(tensor, (full,), f"{self.scheme.kind} weight")
        if tensor.stored_dtype != self.stored:
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; a compressed-tensors "
                f"{self.scheme.kind} checkpoint (quantization_config) stores it as {self.stored}"
            )
        target, dtype = self.weight.data, self.weight.dtype
        if dim == 0:
            target.narrow(0, offset, len(part)).copy_(tensor.read(rows=part, dtype=dtype))
        else:
            target.copy_(tensor.read(columns=part, dtype=dtype))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: each element times its row's (or tensor's) scale."""
        return self._scaled(self.weight.to(torch.float32), dtype)


class PackedInt4Linear(_CompressedTensorsLinear):
    """4-bit weights as published: `weight_packed` int32 [out, ceil(in / 8)] (eight values a
    word, low bits first, stored plus 8), group or channel `weight_scale`, and where asymmetric
    `weight_zero_point` (packed along output rows in the checkpoint; kept unpacked)."""

    packed_names = ("weight_packed",)

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.kinds = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
        self.weight_packed = nn.Parameter(
            torch.empty(self.out_features, _words(self.in_features), dtype=torch.int32),
            requires_grad=False,
        )
        if not self.scheme.symmetric:
            self.packed_names = ("weight_packed", "weight_zero_point")
            self.weight_zero_point = nn.Parameter(
                torch.empty(self.weight_scale.shape, dtype=torch.int8), requires_grad=False
            )

    def _load_packed(self, kind, tensor, dim, part, full, offset) -> None:  # noqa: ANN001
        if tensor.stored_dtype != "I32":
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; a pack-quantized "
                "checkpoint (quantization_config) stores it as I32"
            )
        if kind == "weight_packed":
            _check(tensor, ((full[0], _words(full[1])),), "eight 4-bit values a word")
            target = self.weight_packed.data
            if dim == 0:
                target.narrow(0, offset, len(part)).copy_(tensor.read(rows=part, dtype=torch.int32))
            else:
                words = range(part.start // PER_WORD, _words(part.stop))
                target.copy_(tensor.read(columns=words, dtype=torch.int32))
            return
        if self.scheme.symmetric:
            raise ValueError(
                f"unexpected weight '{tensor.name}': quantization_config says symmetric weights"
            )
        groups = 1 if self.scheme.strategy == "channel" else full[1] // self.group_size
        _check(tensor, ((_words(full[0]), groups),), "zero points packed along output rows")
        target = self.weight_zero_point.data
        if dim == 0:
            words = range(part.start // PER_WORD, _words(part.stop))
            rows = unpack_int4(tensor.read(rows=words, dtype=torch.int32), len(words) * PER_WORD, 0)
            skip = part.start - words.start * PER_WORD
            target.narrow(0, offset, len(part)).copy_(rows[skip : skip + len(part)])
        else:
            cols = (
                range(0, 1)
                if groups == 1
                else range(part.start // self.group_size, part.stop // self.group_size)
            )
            words = tensor.read(columns=cols, dtype=torch.int32)
            target.copy_(unpack_int4(words, full[0], 0))

    def kernel_operands(
        self, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(qweight, scales, zeros, group_size) for `triton_w4a16.w4a16_matmul`, whose layout is
        this one's: the packed words as they are, the scales in `dtype`, and the zero points as
        the kernel's unsigned ones (a stored value less its zero point is q - 8 - z, which the
        kernel computes as q - (z + 8); None when symmetric: the kernel's own 8)."""
        zeros = None
        if not self.scheme.symmetric:
            zeros = (self.weight_zero_point.to(torch.int32) + INT4_OFFSET).to(torch.uint8)
        return self.weight_packed, self.weight_scale.to(dtype), zeros, self.group_size

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """On a GPU with bf16 tensor cores, Triton's W4A16 GEMM reads the packed words as they
        are (`gemm_choice.w4a16_gemm`); elsewhere the torch reference dequantizes per call."""
        if not w4a16_gemm_on(x.device):
            return super().matmul(x, bias)
        from pdserve.kernels.triton_w4a16 import w4a16_matmul  # only where Triton runs

        rows = x.reshape(-1, self.in_features)
        y = w4a16_matmul(rows, *self.kernel_operands(x.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: each 4-bit value less its group's zero point, times
        its group's scale."""
        nibbles = self.weight_packed.view(torch.uint8)
        if sys.byteorder == "big":  # a word's low bits are in its last byte there
            nibbles = nibbles.view(self.out_features, -1, 4).flip(-1)
        out = self.out_features
        values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(out, -1)
        values = values[:, : self.in_features].to(torch.float32) - INT4_OFFSET
        if not self.scheme.symmetric:
            groups = self.weight_zero_point.shape[1]
            zero = self.weight_zero_point.to(torch.float32)[:, :, None]
            values = (values.view(out, groups, -1) - zero).view(out, -1)
        return self._scaled(values, dtype)
