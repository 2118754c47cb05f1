"""Draft only while drafting pays: a per-step choice between the drafter's tree and plain decoding.

Speculation pays when the tokens a step yields per millisecond beat plain decoding's. On a CPU
where every verified row costs real arithmetic (AVX-512 without AMX: 8 rows ~1.7x one row), and
where drafting itself takes a good part of a step (a draft model's passes, heads' projections),
a drafter can lose on text it guesses badly: chat without copying, a draft model that agrees
little. :class:`Pacer` measures both and runs the faster:

    arm "draft":  tokens yielded / wall ms of the steps the drafter proposed   (EMA)
    arm "plain":  tokens yielded / wall ms of the steps verified as the root alone (1 token each)

It starts drafting, tries a few plain steps once it has some evidence, then runs the arm with the
better rate and re-tries the other every ``probe_every`` steps for ``probe_len`` steps, so both
estimates follow the text (a summary's copying phase, a code answer's boilerplate). The choice
cannot change the output: the target verifies every token either way (greedy output and the
sampled distribution are those of plain decoding). A plain step still hands the drafter the
target's result through ``observe`` (path = the root alone, no preceding ``propose``), so drafters
that keep state (heads' hidden state, a draft model's cache) stay in step.
"""

from __future__ import annotations

__all__ = ["Pacer"]


class Pacer:
    """decay: EMA weight kept per step of an arm; warmup: drafting steps before the first plain
    probe; probe_every / probe_len: how often / how long the losing arm is re-tried."""

    def __init__(self, decay: float = 0.8, warmup: int = 3, probe_every: int = 12, probe_len: int = 2):
        if not 0 < decay < 1 or warmup < 1 or probe_len < 1 or probe_every <= probe_len:
            raise ValueError("need 0 < decay < 1, warmup >= 1 and probe_every > probe_len >= 1")
        self.decay, self.warmup, self.probe_every, self.probe_len = decay, warmup, probe_every, probe_len
        self.rate = {True: None, False: None}  # EMA tokens per ms, by arm (True = draft)
        self.steps = {True: 0, False: 0}
        self._since_probe = 0
        self._probing = 0  # steps left on the losing arm
        self._next: bool = True

    @property
    def leader(self) -> bool:
        """The arm with the better rate so far (drafting until plain decoding has been measured)."""
        d, p = self.rate[True], self.rate[False]
        return True if p is None or d is None else d >= p

    def draft_now(self) -> bool:
        """Whether this step should draft (True) or verify the root alone (False)."""
        return self._next

    def record(self, drafted: bool, tokens: int, ms: float) -> None:
        """One step done: ``tokens`` yielded in ``ms`` of wall time, with or without drafting."""
        r = tokens / max(ms, 1e-3)
        old = self.rate[drafted]
        self.rate[drafted] = r if old is None else self.decay * old + (1 - self.decay) * r
        self.steps[drafted] += 1
        if self._probing:
            self._probing -= 1
            self._next = (not self.leader) if self._probing else self.leader
            return
        self._since_probe += 1
        due = self.rate[False] is None and self.steps[True] >= self.warmup  # first measure of plain
        due = due or (self.rate[False] is not None and self._since_probe >= self.probe_every)
        if due:
            self._since_probe = 0
            self._probing = self.probe_len
            self._next = not self.leader if self.rate[False] is not None else False
        else:
            self._next = self.leader

    def to_dict(self) -> dict:
        return {"drafted_steps": self.steps[True], "plain_steps": self.steps[False],
                "draft_tokens_per_s": None if self.rate[True] is None else self.rate[True] * 1e3,
                "plain_tokens_per_s": None if self.rate[False] is None else self.rate[False] * 1e3}
