"""Faults injected into KV transfers on purpose, to prove that the checks catch them: off unless
the environment variable PDSERVE_KV_FAULTS names some, e.g. `corrupt=0.05,seed=7`.

- `corrupt`: the fraction of landings in which one byte is flipped: of a pushed chunk's payload
  as it arrives, before it is written into the pool (a flaky link, a bad staging buffer), or of
  a landed page after a direct write into the pool (a stray write); either way before the
  integrity check reads the pages.

The receiver applies them on its own landing path, so what catches them is the production code.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch

from pdserve.cluster.faults import FaultPlan

ENV = "PDSERVE_KV_FAULTS"


@dataclass(slots=True)
class KVFaults:
    corrupt: float = 0.0
    seed: int = 0
    injected: int = 0  # faults injected so far
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, text: str) -> KVFaults:
        """`corrupt=0.05,seed=7`: raise ValueError naming a part it cannot read."""
        faults = cls()
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            try:
                if key == "corrupt":
                    faults.corrupt = float(value)
                    if not 0.0 <= faults.corrupt <= 1.0:
                        raise ValueError
                elif key == "seed":
                    faults.seed = int(value)
                    faults._rng = random.Random(faults.seed)
                else:
                    raise KeyError
            except (KeyError, ValueError):
                raise ValueError(
                    f"{ENV}: cannot read {part!r} (known: corrupt=P, seed=N)"
                ) from None
        return faults

    @classmethod
    def from_env(cls) -> KVFaults | None:
        """From PDSERVE_KV_FAULTS, or else from the `corrupt` rate of PDSERVE_FAULTS (which
        corrupts control messages too: `cluster/faults.py`)."""
        text = os.environ.get(ENV, "")
        if text:
            return cls.parse(text)
        plan = FaultPlan.from_env()
        if plan is None or not plan.rates.get("corrupt"):
            return None
        return cls(corrupt=plan.rates["corrupt"], seed=plan.seed)

    def in_flight(self, parts: list[torch.Tensor]) -> None:
        """Maybe flip one byte of a pushed chunk's payload (its frames) before it lands."""
        sizes = [p.numel() * p.element_size() for p in parts]
        if not sum(sizes) or self._rng.random() >= self.corrupt:
            return
        index = self._rng.randrange(sum(sizes))
        for part, size in zip(parts, sizes):
            if index < size:
                part.view(-1).view(torch.uint8)[index : index + 1].bitwise_xor_(0x10)
                break
            index -= size
        self.injected += 1

    def after_landing(
        self, kv: torch.Tensor, dst: list[int], layers: tuple[int, int], heads
    ) -> None:
        """Maybe flip one byte of one page just landed in blocks `dst` of `layers`."""
        if not dst or self._rng.random() >= self.corrupt:
            return
        layer = self._rng.randrange(*layers)
        plane = self._rng.randrange(kv.shape[1])
        block = self._rng.choice(dst)
        h0, h1 = (0, kv.shape[4]) if heads is None else heads
        token = self._rng.randrange(kv.shape[3])
        head = self._rng.randrange(h0, h1)
        dim = self._rng.randrange(kv.shape[5])
        element = kv[layer, plane, block, token, head, dim : dim + 1]  # a view into the pool
        element.view(torch.uint8)[:1].bitwise_xor_(0x10)
        self.injected += 1
