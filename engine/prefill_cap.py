"""How many prompt tokens a step that carries decodes may add (stall-free batching).

A step that carries running streams' decodes must not cost much more than a
decode-only step, or every stream stalls while a long prompt prefills
(Sarathi-Serve). The cap is chosen so that such a step costs about twice a
decode-only step, from step costs measured online on this device:

    decode_cost   ≈ the time of a decode-only step (moving average)
    token_cost    ≈ extra time per prompt token in a step that carries decodes
                    (moving averages of extra time and of prompt tokens, a ratio)
    cap           = (ratio - 1) * decode_cost / token_cost,  ratio = 2

Until a step with decodes and prompt tokens has been seen, the per-token cost
comes from prompt-only steps (an idle server's prefills), which overstates it
(a big prefill is compute bound, a small chunk beside decodes mostly is not):
the cap starts low and grows as mixed steps are measured. ``fixed`` (the
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
        self._extra: float | None = None  # seconds a step's prompt tokens add, beside decodes
        self._tokens: float | None = None  # prompt tokens in those steps
        self._prompt_only: float | None = None  # seconds per token of prompt-only steps

    @property
    def token_cost(self) -> float | None:
        """Seconds per prompt token added to a step with decodes (None until measured)."""
        if self._extra is not None:
            return self._extra / self._tokens
        return self._prompt_only

    @property
    def value(self) -> int:
        if self.fixed is not None:
            return self.fixed
        cost = self.token_cost
        if self.decode_cost is None or not cost:
            return self.maximum  # nothing measured yet: no reason to hold back
        cap = int((self.ratio - 1.0) * self.decode_cost / cost)
        return max(self.minimum, min(self.maximum, cap))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step's make-up (decode rows, prompt tokens) and how long it took."""
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_cost = self._avg(self.decode_cost, seconds)
        elif num_decodes == 0:
            self._prompt_only = self._avg(self._prompt_only, seconds / num_prompt_tokens)
        elif self.decode_cost is not None:
            extra = max(seconds - self.decode_cost, 0.0)
            self._extra = self._avg(self._extra, extra)
            self._tokens = self._avg(self._tokens, float(num_prompt_tokens))

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
