"""Draft only while drafting pays: a per-step choice between the drafter's tree and plain decoding.

Speculation pays when the tokens a step yields per millisecond beat plain decoding's. On a CPU
where every verified row costs real arithmetic (AVX-512 without AMX; why:
docs/design-notes.md#tree-size-follows-the-machine), and where drafting itself takes a good part
of a step (a draft model's passes, heads' projections), a drafter can lose on text it guesses
badly: chat without copying, a draft model that agrees little. :class:`Pacer` measures both and runs the faster:

    arm "draft":  tokens yielded / wall ms of the steps the drafter proposed
    arm "plain":  tokens yielded / wall ms of the steps verified as the root alone (1 token each)

each the ratio of two moving sums (tokens, ms) of the arm's steps, aged at every step whichever arm
ran (an average of per-step ratios would favour plain steps: a draft step's rate swings with its
acceptance). Drafting
stays on unless plain decoding is faster by a margin (``margin``), so noise does not flip it.

It starts drafting, tries a few plain steps once it has some evidence, then runs the arm with the
better rate and re-tries the other every ``probe_every`` steps for ``probe_len`` steps, so both
estimates follow the text (a summary's copying phase, a code answer's boilerplate). A probe that
confirms the leader doubles the wait before the next one (up to ``max_probe_every``): a draft
model that does not pay on this machine is hardly run at all. The choice
cannot change the output: the target verifies every token either way (greedy output and the
sampled distribution are those of plain decoding). A plain step still hands the drafter the
target's result through ``observe`` (path = the root alone, no preceding ``propose``), so drafters
that keep state (heads' hidden state, a draft model's cache) stay in step.
"""

from __future__ import annotations

__all__ = ["Pacer"]


class Pacer:
    """decay: weight the moving sums keep per step; warmup: drafting steps before the
    first plain probe; probe_every / probe_len: how often / how long the losing arm is re-tried;
    margin: plain decoding leads only if its rate exceeds drafting's by this factor."""

    def __init__(self, decay: float = 0.9, warmup: int = 6, probe_every: int = 16, probe_len: int = 2,
                 margin: float = 1.05, max_probe_every: int = 64, draft_probe_len: int = 6):
        if not 0 < decay < 1 or warmup < 1 or probe_len < 1 or draft_probe_len < 1 or \
                probe_every <= max(probe_len, draft_probe_len) or margin < 1:
            raise ValueError("need 0 < decay < 1, warmup >= 1, probe_every > probe lengths >= 1 and margin >= 1")
        self.decay, self.warmup, self.probe_every, self.probe_len = decay, warmup, probe_every, probe_len
        self.draft_probe_len = draft_probe_len  # a drafting step's yield varies: probe it longer
        self.margin, self.max_probe_every = margin, max_probe_every
        self._wait = probe_every  # steps between probes (doubles while probes confirm the leader)
        self._leader_before = True
        self._tokens = {True: 0.0, False: 0.0}  # moving sums of tokens and of ms, by arm (True = draft)
        self._ms = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}
        self._fastest = {True: float("inf"), False: float("inf")}  # each arm's quickest step (ms)
        self._since_probe = 0
        self._probing = 0  # steps left on the losing arm
        self._next: bool = True

    def rate(self, drafted: bool) -> float | None:
        """Tokens per ms of an arm's recent steps, None before its first step."""
        return self._tokens[drafted] / self._ms[drafted] if self.steps[drafted] else None

    @property
    def leader(self) -> bool:
        """The arm with the better rate so far (drafting until plain decoding has been measured and
        is faster by ``margin``)."""
        d, p = self.rate(True), self.rate(False)
        return True if p is None or d is None else d * self.margin >= p

    def draft_now(self) -> bool:
        """Whether this step should draft (True) or verify the root alone (False)."""
        return self._next

    def record(self, drafted: bool, tokens: int, ms: float) -> None:
        """One step done: ``tokens`` yielded in ``ms`` of wall time, with or without drafting."""
        for arm in (True, False):  # every step ages both arms' evidence: an arm not run for a while
            self._tokens[arm] *= self.decay  # is judged by its next probe, not by stale steps
            self._ms[arm] *= self.decay
        ms = max(ms, 1e-3)
        self._fastest[drafted] = min(self._fastest[drafted], ms)
        self._tokens[drafted] += tokens
        self._ms[drafted] += min(ms, 3 * self._fastest[drafted])  # a stall of the machine is not the arm's
        self.steps[drafted] += 1
        if self._probing:
            self._probing -= 1
            if not self._probing:  # the probe is over: same leader -> wait longer next time
                same = self.leader == self._leader_before
                self._wait = min(2 * self._wait, self.max_probe_every) if same else self.probe_every
            self._next = (not self.leader) if self._probing else self.leader
            return
        self._since_probe += 1
        measured = self.steps[False] > 0
        due = (not measured and self.steps[True] >= self.warmup) or (measured and self._since_probe >= self._wait)
        if due:
            self._since_probe = 0
            self._leader_before = self.leader
            self._next = not self.leader if measured else False
            self._probing = self.draft_probe_len if self._next else self.probe_len
        else:
            self._next = self.leader

    def to_dict(self) -> dict:
        d, p = self.rate(True), self.rate(False)
        return {"drafted_steps": self.steps[True], "plain_steps": self.steps[False],
                "draft_tokens_per_s": None if d is None else d * 1e3,
                "plain_tokens_per_s": None if p is None else p * 1e3}
