"""The wire protocol between the coordinator and its Python clients (`CoordinatorClient`): a
client submits or cancels; the coordinator streams each request's events back."""

from __future__ import annotations

from pdserve.cluster.codec import Codec, Message
from pdserve.cluster.node_messages import TokenLogprobs
from pdserve.cluster.sampling_params import SamplingParams

CLIENT_PROTOCOL_VERSION = 3  # 3: frames end with a digest


class Submit(Message, tag="submit"):
    request_id: str
    token_ids: list[int]
    params: SamplingParams


class Cancel(Message, tag="cancel"):
    """The client stopped reading: end the request and free it on every node."""

    request_id: str


class Event(Message, tag="event"):
    """Tokens for a client's request, or its end (finish_reason), or an error."""

    request_id: str
    token_ids: list[int] = []
    finish_reason: str | None = None  # stop | length | abort | error
    logprobs: list[TokenLogprobs] = []
    error: str | None = None
    error_code: str | None = None  # overloaded | unavailable | invalid | shutdown | internal
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


client_requests = Codec("client request", CLIENT_PROTOCOL_VERSION, (Submit, Cancel))
client_events = Codec("client event", CLIENT_PROTOCOL_VERSION, (Event,))
