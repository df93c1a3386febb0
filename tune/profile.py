"""A profile: everything the simulator models about one model on one kind of device, saved as
JSON. The step-time and transfer-time models, the KV blocks a node holds, the delays around them,
and where the figures came from (`source`: measured here, from `pdserve.bench.model_step`, or a roofline
of stated peaks), which every output of the tuner repeats."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.tune.model_shape import ModelShape
from pdserve.tune.step_model import StepTimeModel
from pdserve.tune.transfer_model import TransferModel

VERSION = 1


@dataclass(frozen=True, slots=True)
class GroupModel:
    """A node of `size` devices (a tensor-parallel group): its step times, KV pool and sends."""

    size: int
    step: StepTimeModel
    transfer: TransferModel
    kv_blocks: int

    def to_dict(self) -> dict:
        return {
            "size": self.size,
            "step": self.step.to_dict(),
            "transfer": self.transfer.to_dict(),
            "kv_blocks": self.kv_blocks,
        }

    @classmethod
    def from_dict(cls, d: dict) -> GroupModel:
        return cls(
            int(d["size"]),
            StepTimeModel.from_dict(d["step"]),
            TransferModel.from_dict(d["transfer"]),
            int(d["kv_blocks"]),
        )


@dataclass(frozen=True, slots=True)
class Profile:
    model: ModelShape
    dtype: str
    step: StepTimeModel
    transfer: TransferModel
    kv_blocks: int  # KV blocks of one node's pool
    block_size: int = 16
    source: str = ""  # how the figures were made, in a line
    device: str = ""  # what a node runs on, in words
    devices_per_node: int = 1  # devices behind a node of `step`, `transfer` and `kv_blocks`
    # Nodes of other sizes (tensor-parallel groups) the profile also models, e.g. a roofline's.
    groups: tuple[GroupModel, ...] = ()
    # Written as num_kv_blocks in the configs the tuner writes (CPU pools are sized by it; GPU
    # pools by free memory, so it is left out there).
    kv_blocks_setting: bool = False
    hop_s: float = 0.0002  # one message between the coordinator and a node
    frontend_s: float = 0.0  # a client's request in and its first token out, through HTTP
    # What a served engine step takes beyond the modeled one (the node's loop, its reports, the
    # coordinator and the front end passing each token on), measured against a real server.
    step_overhead_s: float = 0.0
    heartbeat_interval_s: float = 0.5
    fit: list[dict] = field(default_factory=list)  # measured points beside the model's times

    @property
    def tp_sizes(self) -> list[int]:
        """The node sizes (devices a node) this profile models."""
        return sorted({self.devices_per_node, *(g.size for g in self.groups)})

    def at_tp(self, size: int) -> Profile:
        """This profile with `step`, `transfer` and `kv_blocks` those of a node of `size`
        devices."""
        if size == self.devices_per_node:
            return self
        for g in self.groups:
            if g.size == size:
                mine = GroupModel(self.devices_per_node, self.step, self.transfer, self.kv_blocks)
                others = tuple(o for o in self.groups if o is not g) + (mine,)
                return replace(
                    self,
                    step=g.step,
                    transfer=g.transfer,
                    kv_blocks=g.kv_blocks,
                    devices_per_node=size,
                    groups=others,
                )
        raise ValueError(f"the profile models nodes of {self.tp_sizes} devices, not {size}")

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size, self.dtype)

    def to_dict(self) -> dict:
        return {
            "version": VERSION,
            "source": self.source,
            "device": self.device,
            "devices_per_node": self.devices_per_node,
            "tensor_parallel": [g.to_dict() for g in self.groups],
            "model": self.model.to_dict(),
            "dtype": self.dtype,
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "kv_blocks_setting": self.kv_blocks_setting,
            "hop_s": self.hop_s,
            "frontend_s": self.frontend_s,
            "step_overhead_s": self.step_overhead_s,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "step": self.step.to_dict(),
            "transfer": self.transfer.to_dict(),
            "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("version") != VERSION:
            raise ValueError(f"profile version {d.get('version')!r}; this pdserve reads {VERSION}")
        return cls(
            model=ModelShape.from_dict(d["model"]),
            dtype=d["dtype"],
            step=StepTimeModel.from_dict(d["step"]),
            transfer=TransferModel.from_dict(d["transfer"]),
            kv_blocks=int(d["kv_blocks"]),
            block_size=int(d.get("block_size", 16)),
            source=d.get("source", ""),
            device=d.get("device", ""),
            devices_per_node=int(d.get("devices_per_node", 1)),
            groups=tuple(GroupModel.from_dict(g) for g in d.get("tensor_parallel", [])),
            kv_blocks_setting=bool(d.get("kv_blocks_setting", False)),
            hop_s=float(d.get("hop_s", 0.0002)),
            frontend_s=float(d.get("frontend_s", 0.0)),
            step_overhead_s=float(d.get("step_overhead_s", 0.0)),
            heartbeat_interval_s=float(d.get("heartbeat_interval_s", 0.5)),
            fit=list(d.get("fit", [])),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a pdserve tune profile ({exc})") from None
