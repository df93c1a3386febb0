"""Per-request sampling parameters: validated when made or decoded off the wire, so bad values
never reach a batch. They travel inside the coordinator's messages to the nodes."""

from __future__ import annotations

import msgspec

from pdserve.cluster.structured_output import StructuredOutput

# Token ids, lengths and top_k are below this: a tensor of them never overflows, whatever a client
# sends (no vocabulary or context comes near it).
INT32 = 2**31


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    # The output's constraint (JSON schema, regex, choice, grammar), enforced on every node.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):  # (from_dict)
            self.structured = StructuredOutput(**self.structured)
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens < INT32:
            raise ValueError(
                f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k < INT32:
            raise ValueError(f"top_k must be -1 (off) or in [0, 2**31), got {self.top_k}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t < INT32), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be token ids in [0, 2**31), got {bad}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed, validated like a new one."""
        return SamplingParams(**{**msgspec.structs.asdict(self), **changes})

    def to_dict(self) -> dict:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Unknown keys are ignored; a bad value raises ValueError naming the field."""
        return cls(**{k: v for k, v in d.items() if k in cls.__struct_fields__})
