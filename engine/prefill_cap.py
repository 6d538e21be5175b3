"""How many prompt tokens a step that carries decodes may add (stall-free batching).

A step that carries running streams' decodes must not cost much more than a
decode-only step, or every stream stalls while a long prompt prefills
(Sarathi-Serve). The cap is chosen so that such a step costs about ``ratio``
(2) times a decode-only step, from step costs measured online on this device:

    decode_cost = moving average of decode-only step times
    token_cost  = (mixed step time - decode_cost) / its prompt tokens
    cap         = (ratio - 1) * decode_cost / token_cost

The first estimate of ``token_cost`` comes from prompt-only steps (an idle
server's prefills). That overstates it, because a big prefill is compute bound
while a small chunk beside decodes mostly rides along with them, so the cap
starts low. Each mixed step that used at least half of the cap then re-estimates
it, and the cap may at most double or halve per step. That damping keeps one
noisy step from swinging it from a trickle to a stall. ``fixed`` (the
``--long-prefill-token-threshold`` flag) replaces the estimate. Torch-free.
"""

from __future__ import annotations


class PrefillCap:
    def __init__(self, maximum: int, fixed: int | None = None, minimum: int = 16,
                 ratio: float = 2.0, smoothing: float = 0.2) -> None:
        self.maximum = maximum
        self.fixed = fixed
        self.minimum = min(minimum, maximum)
        self.ratio = ratio
        self.smoothing = smoothing
        self.decode_cost: float | None = None  # seconds per decode-only step
        self._prompt_only: float | None = None  # seconds per token of prompt-only steps
        self._cap: float | None = None  # the estimate, once there is one

    @property
    def value(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self._cap is None:
            if self.decode_cost is None or self._prompt_only is None:
                return self.maximum  # nothing to go on (and no decodes yet to protect)
            self._cap = self._clamp(self._target(self._prompt_only))
        return int(self._cap)

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step's make-up (decode rows, prompt tokens) and how long it took."""
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_cost = self._avg(self.decode_cost, seconds)
        elif num_decodes == 0:
            self._prompt_only = self._avg(self._prompt_only, seconds / num_prompt_tokens)
        elif self.decode_cost is not None and self._cap is not None and num_prompt_tokens >= self._cap / 2:
            token_cost = max(seconds - self.decode_cost, 0.0) / num_prompt_tokens
            new = self._target(token_cost) if token_cost > 0 else 2 * self._cap
            self._cap = self._clamp(min(max(new, self._cap / 2), 2 * self._cap))

    def _target(self, token_cost: float) -> float:
        return (self.ratio - 1.0) * self.decode_cost / token_cost

    def _clamp(self, cap: float) -> float:
        return max(float(self.minimum), min(float(self.maximum), cap))

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
