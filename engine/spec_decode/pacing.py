"""How many drafts one speculating sequence proposes, from its own record (speculative decoding's
`adaptive` setting, on by default).

A step's drafts are verified in order and kept up to the first the target disagrees with: a step
tests its drafts one at a time until a rejection, and the drafts after a rejection are never
judged. So the sequence's acceptance rate is its accepted drafts over the drafts it had judged,
accepted plus one per step that ended on a rejection (`rate`), not over every draft it proposed
(which would count the unjudged ones as failures and shrink a good draft's limit).

With acceptance rate r, about r / (1 - r) drafts in a row are kept, and the limit is that plus
one (at most k): a draft past it would cost a verified row (and, with a draft model, a forward of
the draft) for little. Below MIN_ACCEPTANCE the sequence stops proposing but for a probe of one
draft now and then; each failed probe doubles the wait for the next, up to MAX_PROBE_INTERVAL
steps, so a draft that never agrees costs a handful of probes over a long output, while an
accepted probe brings the wait back to PROBE_EVERY.
"""

from __future__ import annotations

from dataclasses import dataclass

# The limit follows a sequence's acceptance once this many of its drafts were verified.
ADAPT_AFTER = 8
# Below this acceptance rate a sequence proposes nothing but its probes.
MIN_ACCEPTANCE = 0.1
# Steps (output tokens) from a sequence's pause to its first probe, and the most between probes.
PROBE_EVERY = 8
MAX_PROBE_INTERVAL = 64


@dataclass(slots=True)
class DraftPacing:
    """One sequence's drafts so far, since it started decoding on this node."""

    verified: int = 0  # drafts verified
    accepted: int = 0  # of those, kept
    rejected: int = 0  # steps whose drafts ended on a rejection
    probe_at: int = 0  # while paused: the output length from which it probes
    probe_interval: int = PROBE_EVERY  # while paused: the wait after a failed probe

    @property
    def rate(self) -> float:
        """Accepted drafts over the drafts judged (1.0 while none was rejected)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 1.0

    @property
    def paused(self) -> bool:
        return self.verified >= ADAPT_AFTER and self.rate < MIN_ACCEPTANCE

    def limit(self, k: int, num_output_tokens: int) -> int:
        """How many drafts (at most k) the sequence may propose at this output length."""
        if self.verified < ADAPT_AFTER:
            return k
        if self.rate < MIN_ACCEPTANCE:
            return 1 if num_output_tokens >= self.probe_at else 0
        if not self.rejected:
            return k
        return min(k, self.accepted // self.rejected + 1)  # r / (1 - r), the run, and one more

    def record(self, num_drafts: int, num_accepted: int, num_output_tokens: int) -> None:
        """A step verified num_drafts of its drafts and kept num_accepted; the sequence now has
        num_output_tokens output tokens."""
        probing = self.paused
        self.verified += num_drafts
        self.accepted += num_accepted
        if num_accepted < num_drafts:
            self.rejected += 1
        if not self.paused:
            self.probe_interval = PROBE_EVERY
            return
        if probing:  # a probe: a failed one doubles the wait, a kept one restarts it
            if num_accepted:
                self.probe_interval = PROBE_EVERY
            else:
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self.probe_at = num_output_tokens + self.probe_interval
