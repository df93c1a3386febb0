"""The base of the layers whose weights stay packed into int32 words in memory (AWQ's and
GPTQ's): they keep their checkpoint tensors as stored (packed int32 values and zero points,
float16 scales, int32 group indices) through the model's moves and dtype casts, and check each
tensor's shape and stored dtype as they read it.

On a GPU where Triton's W4A16 GEMM runs (`gemm_choice.w4a16_gemm_on`), a 4-bit layer rewrites
its tensors once, when loaded (or at its first call), into the kernel's layout
(`w4a16_layout`): `kernel_qweight`, `kernel_scales`, `kernel_zeros` and for act-order
`kernel_perm` replace the published ones, so the weight is held once. Its dequantization reads
whichever it holds, so a converted layer moved back to the CPU still runs there."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.quant import w4a16_layout
from pdserve.engine.quant.gemm_choice import w4a16_gemm_on
from pdserve.engine.quant.linear import QuantLinear

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor

# The dtype each stored tensor holds, as safetensors names it and as torch keeps it.
STORED = {
    "qweight": ("I32", torch.int32),
    "qzeros": ("I32", torch.int32),
    "g_idx": ("I32", torch.int32),
    "scales": ("F16", torch.float16),
}


class PackedLinear(QuantLinear):
    """Subclasses hold each of `kinds` as a parameter of that name (its dtype per `STORED`),
    read the published weight (`published_weight`) and say how it converts to the kernel's
    layout (`published_to_kernel`)."""

    format_name = "packed"
    # Set when the kernel's layout cannot hold this layer (8 bits, groups the kernel cannot
    # step through, a rank's share of act-order inputs): it keeps the torch path.
    kernel_unfit: str | None = None

    def _hold(self, kind: str, shape: tuple[int, ...]) -> None:
        tensor = torch.zeros(shape, dtype=STORED[kind][1])
        setattr(self, kind, nn.Parameter(tensor, requires_grad=False))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: ANN202
        """Moves (and `to_empty`) reach the packed tensors (published or the kernel's); dtype
        casts of the model (`model.to(torch.bfloat16)`) do not: they keep their stored dtypes."""
        first = next(p for name, p in self._parameters.items() if name != "bias")
        device = fn(torch.empty(0, device=first.device)).device
        for name, param in list(self._parameters.items()):
            if name == "bias" or param is None:
                continue
            moved = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.detach()), requires_grad=False)
        return self

    # --- the kernel's layout ------------------------------------------------------------------

    @property
    def in_kernel_layout(self) -> bool:
        return "kernel_qweight" in self._parameters

    @property
    def kernel_group(self) -> int:
        """The kernel's group size: the inputs `k // kernel_group` of one scale."""
        return self.group_size

    def published_to_kernel(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, zeros, perm or None) in `w4a16_layout`'s terms; raises ValueError
        naming why where the layout cannot hold this layer."""
        raise NotImplementedError

    def to_kernel_layout(self) -> bool:
        """Replace the published tensors by the kernel's (once; the weight is then held in that
        layout only). False, the layer unchanged, where the kernel cannot read it."""
        if self.in_kernel_layout:
            return True
        if self.kernel_unfit is None:
            try:
                operands = self.published_to_kernel()
            except ValueError as why:
                self.kernel_unfit = str(why)
        if self.kernel_unfit is not None:
            return False
        names = ("kernel_qweight", "kernel_scales", "kernel_zeros", "kernel_perm")
        for kind in self.kinds:
            delattr(self, kind)
        for name, tensor in zip(names, operands, strict=True):
            if tensor is not None:
                setattr(self, name, nn.Parameter(tensor, requires_grad=False))
        return True

    def loaded(self) -> None:
        """All tensors read: on a device that runs the W4A16 kernel, convert now (before any
        graph is captured), not at the first call."""
        if not self.in_kernel_layout and w4a16_gemm_on(self.qweight.device):
            self.to_kernel_layout()

    def _kernel(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (
            self.kernel_qweight,
            self.kernel_scales,
            self.kernel_zeros,
            self._parameters.get("kernel_perm"),
        )

    def kernel_matmul(self, x: torch.Tensor, gemm: w4a16_layout.Gemm) -> torch.Tensor:
        """x [M, in] @ weight^T by `gemm` (the Triton kernel, or its torch reference) on the
        kernel's operands; the layer must be in the kernel's layout."""
        qweight, scales, zeros, perm = self._kernel()
        return w4a16_layout.matmul(
            x, gemm, qweight, scales, zeros, self.kernel_group, perm, self.out_parts
        )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """On a GPU with bf16 tensor cores, Triton's W4A16 GEMM (the layer converted to its
        layout if it was not at load); elsewhere, or where the kernel cannot read the layer,
        the torch dequantization per call."""
        if not (w4a16_gemm_on(x.device) and self.to_kernel_layout()):
            return super().matmul(x, bias)
        from pdserve.kernels.triton_w4a16 import w4a16_matmul  # only where Triton runs

        y = self.kernel_matmul(x.reshape(-1, self.in_features), w4a16_matmul)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (as the format's reference dequantizes it, computed
        in float32), from the published tensors or the kernel's, whichever the layer holds."""
        if not self.in_kernel_layout:
            return self.published_weight(dtype)
        qweight, scales, zeros, perm = self._kernel()
        w = w4a16_layout.dequantize(
            qweight, scales, zeros, self.kernel_group, perm, self.out_parts, self.in_features
        )
        return w.to(dtype)

    def published_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` from the published tensors."""
        raise NotImplementedError

    def _published(self) -> None:
        """Loading reads into the published layout only."""
        if self.in_kernel_layout:
            raise RuntimeError(
                f"this {self.format_name} layer was converted to the W4A16 kernel's layout; "
                "load its checkpoint tensors before it runs"
            )

    def _read(
        self,
        kind: str,
        tensor: CheckpointTensor,
        full: tuple[int, ...],
        rows: range | None = None,
        columns: range | None = None,
    ) -> torch.Tensor:
        """`rows` / `columns` of the checkpoint tensor `kind`, checked to be `full`-shaped and
        stored in the format's dtype."""
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full} "
                f"({self.format_name} layout)"
            )
        stored, dtype = STORED[kind]
        if tensor.stored_dtype != stored:
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; a "
                f"{self.format_name} checkpoint stores it as {stored}"
            )
        return tensor.read(rows=rows, columns=columns, dtype=dtype)

    def _part_at(self, row_offset: int) -> int:
        """The index of the fused part whose output rows start at row_offset."""
        rows = 0
        for i, n in enumerate(self.out_parts):
            if rows == row_offset:
                return i
            rows += n
        raise ValueError(f"no fused part starts at row {row_offset} of {self.out_parts}")


def words(n: int, per_word: int, what: str) -> int:
    """The int32 words that hold `n` packed values, `n` a whole number of them."""
    if n % per_word:
        raise ValueError(f"{what} of {n} is not a multiple of {per_word} (the packed words)")
    return n // per_word


def word_range(part: range, per_word: int) -> range:
    """The words that hold the values `part` (a whole number of words, starting on one)."""
    if part.start % per_word or len(part) % per_word:
        raise ValueError(f"values {part.start}..{part.stop} are not whole words of {per_word}")
    return range(part.start // per_word, part.stop // per_word)
