"""One request as the coordinator tracks it: where it is in the pipeline, which nodes hold it,
the tokens already streamed, and when each of those things happened."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.cluster.sampling_params import SamplingParams


class Phase(enum.Enum):
    WAITING_NODE = "waiting_node"  # no decode node alive: waiting at the coordinator for one
    PREFILLING = "prefilling"  # on a prefill node
    LOCAL_PREFILL = "local_prefill"  # whole request on a decode/colocated node, no token yet
    WAITING_ADMISSION = "waiting_admission"  # prefilled, waiting at the coordinator
    ADMITTING = "admitting"  # a decode node is reserving blocks
    TRANSFERRING = "transferring"  # KV on its way
    DECODING = "decoding"
    DONE = "done"


class EarlyAdmission(enum.Enum):
    """Layer-wise KV streaming: a decode node admitted at the prefill's start (phase is then
    PREFILLING until the first token, then ADMITTING or TRANSFERRING)."""

    NONE = "none"  # admitted after the first token, if at all
    ADMITTING = "admitting"  # Admit sent with the prompt alone, no answer yet
    ADMITTED = "admitted"  # reserved; SendKV sent to the prefill node


PENDING_PHASES = (
    Phase.WAITING_NODE,
    Phase.PREFILLING,
    Phase.LOCAL_PREFILL,
    Phase.WAITING_ADMISSION,
    Phase.ADMITTING,
    Phase.TRANSFERRING,
)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # when the coordinator took it
    output_token_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.PREFILLING
    attempt: int = 0
    prefill_node: str | None = None
    decode_node: str | None = None
    num_blocks: int = 0
    early: EarlyAdmission = EarlyAdmission.NONE
    num_cached_tokens: int = 0
    handoff_started: float = 0.0  # when its current KV handoff began (admission sent)
    waiting_since: float = 0.0  # when it began waiting for a decode node (WAITING_NODE)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # why its last attempt failed (a retry's reason, or its end's)

    @property
    def wire_id(self) -> str:
        """The id nodes know this attempt by; a retry gets a fresh one, so late messages from
        an earlier attempt are recognised and dropped."""
        return f"{self.request_id}#{self.attempt}"

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def remaining_params(self, counted_outputs: int = 0) -> SamplingParams:
        """Params for continuing from prompt + the tokens already streamed, on a node that counts
        the last `counted_outputs` of those as its own outputs (a decode node taking a handoff
        counts the first token; a re-prefill counts none)."""
        remaining = self.params.max_tokens - len(self.output_token_ids) + counted_outputs
        return self.params.replace(max_tokens=remaining)

    def resume_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
