"""The scheme of a compressed-tensors checkpoint (what llm-compressor writes:
`quant_method: compressed-tensors`), read from its config's `config_groups`, `ignore` and
`format`: FP8 weights (per tensor or channel), INT8 W8A8 (per channel) and 4-bit `pack-quantized`
W4A16 (per group or channel, with or without zero points). Anything else is refused by field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.quant.compressed_tensors_reference import PER_WORD
from pdserve.engine.quant.scheme import QUANTIZABLE_PROJECTIONS
from pdserve.engine.quant.scheme import refuse as _refuse

if TYPE_CHECKING:
    from pdserve.engine.quant.linear import QuantLinear, RankGroup

FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")
# (type, num_bits) -> the formats that store such weights.
WEIGHT_KINDS = {
    ("float", 8): ("float-quantized", "naive-quantized"),
    ("int", 8): ("int-quantized", "naive-quantized"),
    ("int", 4): ("pack-quantized",),
}
# Fields of a weights (or activations) entry that may hold only their default.
DEFAULTS = {"actorder": None, "block_structure": None, "dynamic": False}


@dataclass(frozen=True, slots=True)
class CompressedTensorsScheme:
    """One quantization of every targeted linear layer: `kind` `fp8` (float8_e4m3fn `weight`),
    `int8` (int8 `weight`) or `int4` (`weight_packed`); `strategy` `tensor`, `channel` or
    `group` (of `group_size` input columns); `symmetric` False only for int4 (its
    `weight_zero_point`); `static_input`: the checkpoint holds an `input_scale` per layer (a
    static FP8 activation scale, read and not applied: activations stay in the model's dtype,
    as transformers runs such a checkpoint decompressed). `targets` and `ignore` are matched as
    compressed-tensors does: `Linear`, an exact module name, or `re:` a regex from the start."""

    kind: str
    strategy: str
    group_size: int | None = None
    symmetric: bool = True
    static_input: bool = False
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qcfg: dict) -> CompressedTensorsScheme:
        method = qcfg.get("quant_method")
        if method != "compressed-tensors":
            raise _refuse("quant_method", method, "'compressed-tensors'")
        for field, supported in (
            ("sparsity_config", "none (dense weights)"),
            ("transform_config", "none (no rotations)"),
        ):
            if qcfg.get(field):
                raise _refuse(field, qcfg[field], supported)
        if qcfg.get("kv_cache_scheme"):
            raise _refuse(
                "kv_cache_scheme",
                qcfg["kv_cache_scheme"],
                "none; an FP8 KV cache is pdserve's --kv-cache-dtype, not the checkpoint's",
            )
        ignore = qcfg.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
            raise _refuse("ignore", ignore, "a list of module names or 're:' patterns")
        groups = qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _refuse("config_groups", groups, "one or more groups of targets and weights")
        top_format = qcfg.get("format")
        read = [_group(f"config_groups.{n}", g, top_format) for n, g in groups.items()]
        first = read[0][0]
        for (scheme, _), name in zip(read[1:], list(groups)[1:], strict=True):
            if scheme != first:
                raise _refuse(
                    f"config_groups.{name}",
                    groups[name],
                    f"the same weights and activations in every group (as {list(groups)[0]})",
                )
        targets = tuple(t for _, group_targets in read for t in group_targets)
        scheme = cls(**{**first, "targets": targets, "ignore": tuple(ignore)})
        if scheme._matches("lm_head", scheme.targets) and not scheme._matches("lm_head", ignore):
            raise _refuse(
                "ignore", ignore, "a list holding 'lm_head' (pdserve keeps the head unquantized)"
            )
        return scheme

    # --- what the models ask ---------------------------------------------------------------------

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (its full name, e.g.
        model.layers.0.self_attn.q_proj) quantized: a projection a target names and no `ignore`
        entry does."""
        if module.rsplit(".", 1)[-1] not in QUANTIZABLE_PROJECTIONS:
            return False
        return self._matches(module, self.targets) and not self._matches(module, self.ignore)

    @staticmethod
    def _matches(module: str, names: tuple[str, ...] | list[str]) -> bool:
        """compressed-tensors' `is_match` for a linear layer: its class `Linear`, its exact name,
        or a `re:` pattern matched from the start of the name."""
        for name in names:
            if name == "Linear" or name == module:
                return True
            if name.startswith("re:") and re.match(name[3:], module):
                return True
        return False

    @property
    def label(self) -> str:
        what = {"fp8": "fp8 e4m3", "int8": "int8", "int4": "int4 (packed)"}[self.kind]
        per = f"groups of {self.group_size}" if self.strategy == "group" else self.strategy
        zero = "" if self.symmetric else ", zero points"
        return f"compressed-tensors {what}, scales per {per}{zero}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        if self.kind == "int4":
            names = ("weight_packed", "weight_scale", "weight_shape")
            return names if self.symmetric else (*names, "weight_zero_point")
        return (
            ("weight", "weight_scale", "input_scale")
            if self.static_input
            else ("weight", "weight_scale")
        )

    @property
    def alignment(self) -> tuple[int, int]:
        """Columns of 4-bit weights: whole packed words of eight, and whole groups (zero points,
        packed along rows, are unpacked on load, so rows start anywhere)."""
        if self.kind != "int4":
            return (1, 1)
        return (1, math.lcm(PER_WORD, self.group_size or 1))

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> QuantLinear:
        from pdserve.engine.quant.compressed_tensors_linear import (
            PackedInt4Linear,
            ScaledInt8Fp8Linear,
        )

        if self.kind == "int4":
            return PackedInt4Linear(in_features, out_parts, bias, self, group)
        return ScaledInt8Fp8Linear(in_features, out_parts, bias, self, group)


def _group(where: str, group: object, top_format: object) -> tuple[dict, list[str]]:
    """(the scheme's fields, the targets) of one config group; refused by field."""
    if not isinstance(group, dict):
        raise _refuse(where, group, "an object of targets and weights")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _refuse(
            f"{where}.targets", targets, "a list of 'Linear', module names or 're:' patterns"
        )
    for target in targets:
        if target != "Linear" and not target.startswith("re:"):
            if target.rsplit(".", 1)[-1] not in QUANTIZABLE_PROJECTIONS:
                raise _refuse(
                    f"{where}.targets",
                    targets,
                    "'Linear', 're:' patterns or names of q/k/v/o and gate/up/down projections",
                )
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "none")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"{where}.weights", weights, "an object (num_bits, type, strategy, ...)")
    w = f"{where}.weights"
    for field, default in DEFAULTS.items():
        if weights.get(field, default) not in (default, False):
            raise _refuse(f"{w}.{field}", weights[field], repr(default))
    kind_key = (weights.get("type"), weights.get("num_bits"))
    if kind_key not in WEIGHT_KINDS:
        raise _refuse(
            f"{w}.num_bits",
            weights.get("num_bits"),
            f"8 with type 'float' or 'int', 4 with type 'int' (type here: {weights.get('type')!r})",
        )
    kind = {("float", 8): "fp8", ("int", 8): "int8", ("int", 4): "int4"}[kind_key]
    fmt = group.get("format") or top_format
    if fmt not in WEIGHT_KINDS[kind_key]:
        field = f"{where}.format" if group.get("format") else "format"
        raise _refuse(
            field,
            fmt,
            " or ".join(repr(f) for f in WEIGHT_KINDS[kind_key]) + f" for {kind} weights",
        )
    strategy = weights.get("strategy")
    strategies = {"fp8": ("tensor", "channel"), "int8": ("channel",), "int4": ("group", "channel")}
    if strategy not in strategies[kind]:
        raise _refuse(
            f"{w}.strategy",
            strategy,
            " or ".join(repr(s) for s in strategies[kind]) + f" for {kind} weights",
        )
    group_size = weights.get("group_size")
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise _refuse(f"{w}.group_size", group_size, "a positive integer with strategy 'group'")
    else:
        group_size = None
    symmetric = weights.get("symmetric", True)
    if symmetric is not True and (kind != "int4" or symmetric is not False):
        raise _refuse(f"{w}.symmetric", symmetric, "true" + (" or false" if kind == "int4" else ""))
    fields = {"kind": kind, "strategy": strategy, "group_size": group_size, "symmetric": symmetric}
    return {
        **fields,
        "static_input": _activations(where, group.get("input_activations"), kind),
    }, targets


def _activations(where: str, acts: object, kind: str) -> bool:
    """Whether the checkpoint holds a static `input_scale` per layer: W4A16 has none; FP8 takes
    dynamic per-token or static per-tensor FP8 activations, INT8 dynamic per-token int8 ones
    (neither applied: activations stay in the model's dtype)."""
    a = f"{where}.input_activations"
    if acts is None:
        if kind == "int8":
            raise _refuse(a, acts, "dynamic per-token int8 activations for int8 weights (W8A8)")
        return False
    if kind == "int4":
        raise _refuse(a, acts, "none for 4-bit weights (W4A16)")
    if not isinstance(acts, dict):
        raise _refuse(a, acts, "an object (num_bits, type, strategy, dynamic)")
    want_type = "float" if kind == "fp8" else "int"
    if (acts.get("type"), acts.get("num_bits")) != (want_type, 8):
        raise _refuse(
            f"{a}.type", acts.get("type"), f"{want_type!r} with num_bits 8 for {kind} weights"
        )
    if acts.get("symmetric", True) is not True:
        raise _refuse(f"{a}.symmetric", acts.get("symmetric"), "true")
    dynamic, strategy = acts.get("dynamic"), acts.get("strategy")
    if dynamic is True and strategy == "token":
        return False
    if kind == "fp8" and dynamic is False and strategy == "tensor":
        return True
    supported = "dynamic 'token'" + (" or static (dynamic false) 'tensor'" if kind == "fp8" else "")
    raise _refuse(f"{a}.strategy", f"{strategy} (dynamic {dynamic})", supported)
