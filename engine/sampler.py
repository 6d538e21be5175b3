"""The batched sampler: one call per engine step turns a batch of logits into token ids.

Owns everything between the model's last-position logits and the sampled ids:
min_tokens masking, logit bias, allowed_token_ids and bad_words, repetition / presence / frequency
penalties, structured output's grammar masks, greedy argmax, temperature, top-k, top-p, min-p, per-request seeds and logprobs;
llama.cpp's samplers (DRY, XTC, typical, top-n-sigma, dynamic temperature, mirostat) come from
``engine.sampler_llamacpp``, which says where they stand in this order.
It knows nothing of scheduling: the engine hands it the rows that need a token,
each row's ``SamplingParams``, its ``SamplingState`` and its token history.

Semantics follow vLLM v1:
- processing order: min_tokens -> logit_bias -> allowed_token_ids -> bad_words -> repetition
  penalty -> presence / frequency penalties -> grammar mask -> (greedy rows: argmax) -> temperature
  -> top-k -> top-p -> min-p -> sample; a request's ``repeat_last_n`` (llama.cpp's) counts the three
  penalties over the context's last N tokens instead, as llama.cpp does;
- logprobs are the RAW model logprobs (``log_softmax`` of the logits as given),
  not of the processed distribution;
- a seeded request's tokens depend only on its seed and on how many tokens it has
  sampled, never on the rest of the batch: sampling is an exponential race
  (``argmax(probs / q)``, ``q ~ Exp(1)``) and a seeded row's ``q`` is a hash of
  (seed, tokens sampled so far, token id), computed on the logits' device with integer
  ops that give the same bits on every device (``kernels.reference.exponentials``). A step that is
  run again (after an out-of-memory rollback, or a preemption) draws the same noise. On CUDA the
  non-greedy rows race in one Triton kernel (``kernels.sample_race``) that never sorts the
  vocabulary, but those of llama.cpp's samplers: the same draws pick the same token as masking
  by top-k, top-p and min-p first (the unseeded rows' keys come from the engine's generator).

Hot-path rule: no per-request Python loops beyond building small tensors from each
row's scalar knobs (and the seeded rows' hash keys); the params' lists (stop ids,
logit_bias) become tensors once per request in ``SamplingState``, so a step's cost
never grows with their length. An all-greedy batch with nothing to process is a
single ``argmax``.

``Sampler.sample`` leaves the ids (and logprobs) on the device; ``Sampled.result()`` is the
host sync, so that the engine can collect a step after launching the next (asynchronous
scheduling). A row's sampled-token count, which min_tokens and the seeded noise use, may then
include a token still in flight (``num_output_tokens``), which the penalties read on the device
(``in_flight``). Bad words, DRY, mirostat and grammars need it on the host: a step that samples
such a row samples once the step before has reached the host (``SamplingState.waits``; its forward
does not wait).
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

import kernels
from engine import sampler_llamacpp as llamacpp
from engine.protocol import SamplingParams
from engine.structured import GrammarMatcher, StateInfo
from kernels import reference

_SEED_MASK = (1 << 64) - 1  # seeds are 64-bit; fold bigger (or negative) ones in
_MASK32 = (1 << 32) - 1
_XTC_SALT = 0x5854432D44524157  # a seeded row's XTC draws: a stream of their own
# What a step asks of a row, as bits of ``SamplingState.kind``: a step reads its rows' kinds in one pass (a set of a
# few values), and looks for the rows of a kind only where some row has it (most steps: none have most kinds)
_GREEDY, _PLAIN, _LOGPROBS, _LLAMACPP, _SEEDED, _MIN_TOKENS, _TOP_K, _TOP_P, _MIN_P = (1 << i for i in range(9))
_EVERY_KIND = (1 << 9) - 1
_LOGPROBS_CHUNK = 1024  # rows per log_softmax in logprob_tensors: bounds memory for long prompts


class SamplingState:
    """Per-request sampler state, created once with the request and kept across steps.

    Holds the request's seed folded to 64 bits (None when unseeded), a few flags
    derived from the params once, so the per-step checks stay cheap, and the params' lists turned
    into tensors once: the stop ids that min_tokens bans and the logit_bias ids and
    values. A step only gathers these (``process_logits``), so its cost does not
    grow with the length of the lists.

    The engine's seed does not enter a seeded request's noise: the same ``seed``
    must give the same tokens on every engine (data-parallel ranks, restarts), as
    in vLLM and OpenAI. Unseeded requests draw from the ``Sampler``'s own generator,
    which the engine seeds with its ``--seed``.
    """

    __slots__ = ("seed", "greedy", "plain", "kind", "knobs", "needs_penalties", "reads_output", "waits", "grammar",
                 "bad_words", "allowed", "dry_breakers", "mu", "llamacpp", "_bad_after", "_prompt_len", "_prompt_ids",
                 "_window_len", "_window", "_dry_prompt", "_stop_ids", "_bias_ids", "_bias_values", "_allowed_ids",
                 "_placed_for", "_placed")

    def __init__(self, params: SamplingParams, grammar: GrammarMatcher | None = None) -> None:
        self.grammar = grammar  # structured output: where the request's output stands in its grammar
        self.seed = None if params.seed is None else params.seed & _SEED_MASK
        self.needs_penalties = params.repeat_last_n != 0 and (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        # bad_words: (the word's tokens but its last, its last); a step reads the output's last tokens for them:
        # the one-token words always, the others by the token before their last (most steps: none)
        self.bad_words = [(tuple(w[:-1]), w[-1]) for w in params.bad_words_token_ids or ()]
        self._bad_after: dict[int | None, list[tuple[tuple, int]]] = {}
        for head, last in self.bad_words:
            self._bad_after.setdefault(head[-1] if head else None, []).append((head, last))
        self.allowed = frozenset(params.allowed_token_ids) if params.allowed_token_ids else None
        self.dry_breakers = llamacpp.Breakers.of(params.dry_breaker_token_ids) if params.dry else None
        # mirostat's surprise target (bits), moved by each token sampled (``Sampled.result``)
        self.mu = 2.0 * params.mirostat_tau if params.mirostat else None
        # one of llama.cpp's truncations or a dynamic temperature (a step looks for them among these rows only)
        self.llamacpp = bool(params.mirostat or params.typical_p < 1.0 or params.top_n_sigma > 0
                             or params.xtc or params.dynatemp_range > 0)
        # the sampler reads the output so far (the host's list), or mirostat's target that the last token moved
        self.reads_output = self.needs_penalties or bool(self.bad_words) or params.dry or self.mu is not None
        # a step's sampling waits for the step before, which samples its last token, to reach the host
        # (asynchronous scheduling): bad words, DRY, mirostat and a grammar read that token there; the
        # penalties read it on the device
        self.waits = bool(self.bad_words or params.dry or self.mu is not None or grammar is not None)
        # Nothing for ``process_logits`` to do (min_tokens is checked per step, since it stops mattering after a
        # while); greedy too and no logprobs: eligible for the argmax-only fast path.
        self.greedy = params.greedy
        self.plain = (not self.reads_output and not params.logit_bias and grammar is None
                      and params.allowed_token_ids is None)
        # temperature, top_k, top_p, min_p as a step applies them: mirostat takes the truncations' place, and a
        # dynamic temperature is applied after them
        temperature = 1.0 if params.dynatemp_range > 0 and not params.mirostat else params.temperature
        # (top_k held to 2**24, exact in float32 and past any vocabulary: no cut, as any larger k)
        cut = (0, 1.0, 0.0) if params.mirostat else (min(params.top_k, 1 << 24), params.top_p, params.min_p)
        knobs = array.array("f", (temperature, *cut))
        self.knobs = knobs.tobytes()  # (float32s: a step joins the rows')
        self.kind = (_GREEDY * self.greedy | _PLAIN * self.plain | _LOGPROBS * (params.logprobs is not None)
                     | _LLAMACPP * self.llamacpp | _SEEDED * (self.seed is not None)
                     | _MIN_TOKENS * (params.min_tokens > 0) | _TOP_K * (knobs[1] > 0) | _TOP_P * (knobs[2] < 1.0)
                     | _MIN_P * (knobs[3] > 0.0))
        self._prompt_len = self._window_len = -1
        self._prompt_ids: torch.Tensor | None = None
        self._window: torch.Tensor | None = None  # the prompt's part of llama.cpp's window
        self._dry_prompt: np.ndarray | None = None  # the prompt, for DRY's window
        # Stop ids matter to the sampler only while min_tokens bans them.
        self._stop_ids = _long_tensor(params.stop_token_ids if params.min_tokens > 0 else [])
        bias = params.logit_bias or {}
        self._bias_ids = _long_tensor(list(bias))
        self._bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self._allowed_ids = _long_tensor(sorted(set(params.allowed_token_ids or ())))
        self._placed_for: tuple[int, torch.device] | None = None
        self._placed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to process and no logprobs: a row of the argmax-only fast path."""
        return self.kind & (_GREEDY | _PLAIN | _LOGPROBS) == _GREEDY | _PLAIN

    def prompt_ids(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """The prompt's distinct token ids as a CPU tensor, built once (repetition penalty)."""
        if self._prompt_ids is None or self._prompt_len != len(prompt_token_ids):
            self._prompt_ids = torch.tensor(prompt_token_ids, dtype=torch.long).unique()
            self._prompt_len = len(prompt_token_ids)
        return self._prompt_ids

    def penalized(self, prompt_token_ids: list[int], output_token_ids: list[int], last_n: int | None) -> torch.Tensor:
        """The tokens a row's penalties count, as a CPU tensor: the output (vLLM's rules, ``last_n`` None), or
        llama.cpp's window, the context's last ``last_n`` tokens (-1: all), whose prompt part is built once."""
        out = output_token_ids
        if last_n is None or 0 < last_n <= len(out):
            return torch.tensor(out if last_n is None else out[len(out) - last_n:], dtype=torch.long)
        if self._window is None or self._window_len != len(prompt_token_ids):
            keep = len(prompt_token_ids) if last_n < 0 else min(last_n, len(prompt_token_ids))
            self._window = torch.tensor(prompt_token_ids[len(prompt_token_ids) - keep:], dtype=torch.long)
            self._window_len = len(prompt_token_ids)
        head = self._window if last_n < 0 else self._window[max(0, len(self._window) - (last_n - len(out))):]
        return torch.cat((head, torch.tensor(out, dtype=torch.long)))

    def dry_window(self, prompt_token_ids: list[int], output_token_ids: list[int], last_n: int) -> np.ndarray:
        """DRY's window: the context's last ``last_n`` tokens (-1: all), int64; the prompt's array built once."""
        if self._dry_prompt is None or len(self._dry_prompt) != len(prompt_token_ids):
            self._dry_prompt = np.asarray(prompt_token_ids, np.int64)
        out = np.asarray(output_token_ids, np.int64)
        if 0 < last_n <= len(out):
            return out[len(out) - last_n:]
        head = self._dry_prompt if last_n < 0 else self._dry_prompt[max(0, len(self._dry_prompt) - last_n + len(out)):]
        return np.concatenate((head, out))

    def tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
        """(stop ids min_tokens bans, logit_bias ids, their values, allowed_token_ids) on ``device``, ids <
        ``vocab`` only.

        Filtered and copied on first use, then cached: the vocab and device of a
        sampler do not change, so this happens once per request.
        """
        if self._placed_for != (vocab, device):
            keep = self._bias_ids < vocab
            self._placed = (to_device(self._stop_ids[self._stop_ids < vocab], device),
                            to_device(self._bias_ids[keep], device), to_device(self._bias_values[keep], device),
                            to_device(self._allowed_ids[self._allowed_ids < vocab], device))
            self._placed_for = (vocab, device)
        return self._placed

    def banned(self, output_token_ids: list[int]) -> list[int]:
        """The bad words' last tokens that may not come next: those whose other tokens end the output."""
        out = [last for _, last in self._bad_after.get(None, ())]
        if output_token_ids:
            n = len(output_token_ids)
            out += [last for head, last in self._bad_after.get(output_token_ids[-1], ())
                    if tuple(output_token_ids[n - len(head):]) == head]
        return out


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` (or the CPU tensor ``data``) on ``device``: to a GPU through
    pinned memory, queued without waiting. A copy from pageable memory waits for the stream, so with a
    step in flight (asynchronous scheduling) it would wait for that whole step."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Each (uint8) row of ``packed`` as ``np.unpackbits(row, count=n)`` would give it, as bools, on the row's
    device (bits past a row's end are False)."""
    if packed.device.type == "cpu":  # (numpy's is the faster on the host: a twentieth of the shifts' time)
        return torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, count=n).view(bool))
    return _unpack_bits_by_shifts(packed, n)


def _unpack_bits_by_shifts(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(packed), -1).bool()
    if bits.shape[1] < n:
        return torch.cat([bits, bits.new_zeros(len(packed), n - bits.shape[1])], dim=1)
    return bits[:, :n]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal largest; a NaN counts as largest): ``max``'s indices, which on the CPU
    take half of bf16 ``argmax``'s time (32 x 49152: 1.3 against 2.9 ms here), the same ids."""
    return logits.max(dim=-1).indices


def _forbid(logits: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
    """``logits[index] = -inf`` without a host sync: on CUDA, ``__setitem__`` makes a Python number a CPU
    tensor and copies it to the GPU from pageable memory, which waits for the stream."""
    logits.index_put_(index, logits.new_full((), -math.inf))


def _long_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)


@dataclass
class Sampled:
    """A step's sampled ids still on the device, and the logprobs tensors of the rows that asked
    (their rows, each one's k, ``logprob_tensors``' output): nothing waited for yet."""

    ids: torch.Tensor  # (B,)
    logprobs: tuple[list[int], list[int], tuple[torch.Tensor, ...]] | None = None
    mirostat: tuple[list[SamplingState], torch.Tensor] | None = None  # the mirostat rows' states, their next mu

    def to_host(self) -> Sampled:
        """The same, copied to the host's pinned memory without waiting (from CUDA): read them (``result``)
        only once the stream has done the copies."""
        lp, miro = self.logprobs, self.mirostat
        return Sampled(self.ids.to("cpu", non_blocking=True),
                       lp and (lp[0], lp[1], tuple(t.to("cpu", non_blocking=True) for t in lp[2])),
                       miro and (miro[0], miro[1].to("cpu", non_blocking=True)))

    def result(self) -> SamplerOutput:
        """The host's copy: waits for the device to have sampled (and moves the mirostat rows' targets)."""
        if self.mirostat is not None:
            for state, mu in zip(self.mirostat[0], self.mirostat[1].tolist(), strict=True):
                state.mu = mu
        logprobs = None
        if self.logprobs is not None:
            rows, ks, tensors = self.logprobs
            logprobs = [None] * len(self.ids)
            for i, entry in zip(rows, logprob_entries(*tensors, ks), strict=True):
                logprobs[i] = entry
        return SamplerOutput(self.ids.tolist(), logprobs)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # (B,) sampled ids
    # per row: [sampled_logprob, top-k packed (protocol.pack_top), rank] (protocol.TokenLogprobs, as Outputs
    # carries it), or None for a row that did not ask; the whole list is None when no row asked
    logprobs: list[list | None] | None


# ----------------------------------------------------------------------------- logprobs


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor | list[int],
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs on the device, without a host sync: the (N,) logprobs of ``token_ids`` under
    ``logits`` (N, V), the (N, k) top logprobs and their ids (descending), and each token's (N,) rank
    (1 + the tokens more likely than it, vLLM's). Works in chunks of rows so prompt logprobs over a
    long prompt do not materialise an (N, V) float32 copy."""
    n, vocab = logits.shape
    if not isinstance(token_ids, torch.Tensor):
        token_ids = torch.tensor(token_ids, dtype=torch.long)
    token_ids = token_ids.to(logits.device, torch.long)
    k = min(k, vocab)
    tok, top_lp, top_ids, ranks = [], [], [], []
    for start in range(0, n, _LOGPROBS_CHUNK):
        # (float32 from the model's dtype inside the op: no float32 copy of the chunk beside its result)
        lp = torch.log_softmax(logits[start:start + _LOGPROBS_CHUNK], dim=-1, dtype=torch.float32)  # (n, V)
        t = lp.gather(1, token_ids[start:start + _LOGPROBS_CHUNK, None])
        tok.append(t.squeeze(1))
        ranks.append((lp > t).sum(dim=1) + 1)
        values, ids = lp.topk(k, dim=-1)  # (n, k), sorted descending
        top_lp.append(values)
        top_ids.append(ids)
    return torch.cat(tok), torch.cat(top_lp), torch.cat(top_ids), torch.cat(ranks)


def logprob_entries(tok_lp: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor, ranks: torch.Tensor,
                    ks: list[int] | None = None) -> list[list]:
    """``logprob_tensors``' output on the host (the sync): one ``[logprob, top-k, rank]`` per row, the top-k
    packed as ``Outputs`` carries it (``protocol.pack_top``: no list a pair), ``ks[i]`` of row i's (all of
    them where None; empty for ``k == 0``)."""
    pairs = torch.stack((top_ids.to(torch.int32), top_lp.float().view(torch.int32)), dim=-1)  # (n, k, 2)
    packed = np.ascontiguousarray(pairs.cpu().numpy(), "<i4").tobytes()
    k_max = top_ids.shape[1]  # (the vocabulary's size where a row asked for more: a row's k is cut to it)
    width = 8 * k_max  # (bytes a row)
    if ks is None:
        return [[t, packed[j * width:(j + 1) * width], r]
                for j, (t, r) in enumerate(zip(tok_lp.tolist(), ranks.tolist(), strict=True))]
    return [[t, packed[j * width:j * width + 8 * min(k, k_max)], r]
            for j, (t, k, r) in enumerate(zip(tok_lp.tolist(), ks, ranks.tolist(), strict=True))]


# ----------------------------------------------------------------------------- processing


def pad_token_ids(rows: list[torch.Tensor], pad: int, device: torch.device | str) -> torch.Tensor:
    """Stack 1-D id tensors into (n, L), padded with ``pad`` (a spare column index)."""
    if not rows or max(r.numel() for r in rows) == 0:
        return torch.full((len(rows), 1), pad, dtype=torch.long, device=device)
    return to_device(pad_sequence(rows, batch_first=True, padding_value=pad), device)


def _gather_rows(row_ids: list[tuple[int, torch.Tensor]],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(row index per id, the ids) for index_put_ from each row's id tensor; (None, None) if none."""
    row_ids = [(i, t) for i, t in row_ids if t.numel()]
    if not row_ids:
        return None, None
    cols = torch.cat([t for _, t in row_ids])
    counts = to_device([t.numel() for _, t in row_ids], device)
    rows = to_device([i for i, _ in row_ids], device)
    # output_size: the length is known here, so CUDA need not sync to learn it
    return rows.repeat_interleave(counts, output_size=cols.numel()), cols


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: torch.Tensor | None,
    output_tokens: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties; use the returned tensor.

    May write into ``logits``.

    logits (n, V); prompt_tokens / output_tokens (n, L) token ids padded with V;
    presence, frequency, repetition (n,). Repetition (HF/CTRL) sees prompt and output
    tokens: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. Presence and frequency (OpenAI) see output tokens only:
    ``logit -= presence * [count > 0] + frequency * count``.
    """
    n, vocab = logits.shape
    # One spare column absorbs the padding, so padded rows need no mask.
    counts = torch.zeros((n, vocab + 1), dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_tokens, torch.ones_like(output_tokens, dtype=logits.dtype))
    counts = counts[:, :vocab]
    output_seen = counts > 0
    if repetition is not None:
        seen = output_seen
        if prompt_tokens is not None:
            in_prompt = torch.zeros((n, vocab + 1), dtype=torch.bool, device=logits.device)
            in_prompt.scatter_(1, prompt_tokens, True)
            seen = seen | in_prompt[:, :vocab]
        r = repetition.to(logits.dtype).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    logits -= frequency.to(logits.dtype).unsqueeze(1) * counts
    logits -= presence.to(logits.dtype).unsqueeze(1) * output_seen
    return logits


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[SamplingState],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int],
    num_output_tokens: list[int] | None = None,
    in_flight: Callable[[list[int]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The argmax-changing stage, applied before greedy rows pick: min_tokens, logit bias, penalties.

    ``num_output_tokens``: how many tokens each row has sampled before this one, when more than its
    ``output_token_ids`` hold (a token still in flight: asynchronous scheduling; only in rows whose
    ``SamplingState.waits`` is False). ``in_flight(rows)``: those rows' tokens in flight, on the device (the
    penalties count them).
    Returns a new float32 tensor; ``logits`` itself is left untouched (the caller
    still needs the raw values for logprobs).
    """
    logits = logits.float().clone()
    n, vocab = logits.shape
    device = logits.device
    if num_output_tokens is None:
        num_output_tokens = [len(out) for out in output_token_ids]

    # min_tokens: EOS (unless ignore_eos) and stop ids may not end the request yet.
    # The ids come from each row's state as ready-made tensors: no walk over the lists.
    early = [i for i, (p, m) in enumerate(zip(params, num_output_tokens, strict=True)) if m < p.min_tokens]
    if early:
        eos = [t for t in eos_token_ids if 0 <= t < vocab]
        eos_rows = [i for i in early if not params[i].ignore_eos]
        if eos and eos_rows:
            _forbid(logits, (to_device(eos_rows, device).unsqueeze(1), to_device(eos, device)))
        rows, cols = _gather_rows([(i, states[i].tensors(vocab, device)[0]) for i in early], device)
        if rows is not None:
            _forbid(logits, (rows, cols))

    # logit_bias: added to the logits as given (ids outside the vocab are ignored).
    biased = [(i, states[i].tensors(vocab, device)) for i, p in enumerate(params) if p.logit_bias]
    rows, cols = _gather_rows([(i, t[1]) for i, t in biased], device)
    if rows is not None:
        vals = torch.cat([t[2] for _, t in biased])
        logits.index_put_((rows, cols), vals, accumulate=True)

    # allowed_token_ids: every other token out; bad_words: a word's last token out after its others.
    allowed = [(i, states[i].tensors(vocab, device)[3]) for i, p in enumerate(params) if p.allowed_token_ids]
    rows, cols = _gather_rows(allowed, device)
    if rows is not None:
        kept = logits[rows, cols]
        _forbid(logits, (to_device([i for i, _ in allowed], device),))
        logits[rows, cols] = kept
    banned = [(i, b) for i, s in enumerate(states) if s.bad_words for b in s.banned(output_token_ids[i]) if b < vocab]
    if banned:
        _forbid(logits, (to_device([i for i, _ in banned], device), to_device([b for _, b in banned], device)))

    # Penalties: tensors only for the rows that ask, padded with the spare column V.
    # (A row with llama.cpp's window counts its window as its output, and has no prompt of its own.)
    pen = [i for i, s in enumerate(states) if s.needs_penalties]
    if pen:
        sub_params = [params[i] for i in pen]
        # (a token still in flight: -1 here, then read on the device)
        flying = [num_output_tokens[i] > len(output_token_ids[i]) for i in pen]
        outputs = pad_token_ids([states[i].penalized(prompt_token_ids[i], output_token_ids[i] + [-1] if f
                                                     else output_token_ids[i], params[i].repeat_last_n)
                                 for i, f in zip(pen, flying, strict=True)], vocab, device)
        if any(flying):
            outputs = torch.where(outputs < 0, in_flight(pen).unsqueeze(1), outputs)
        repetition = prompts = None
        if any(p.repetition_penalty != 1.0 for p in sub_params):
            repetition = to_device([p.repetition_penalty for p in sub_params], device)
            empty = torch.empty(0, dtype=torch.long)
            prompts = pad_token_ids(
                [states[i].prompt_ids(prompt_token_ids[i])
                 if params[i].repetition_penalty != 1.0 and params[i].repeat_last_n is None else empty for i in pen],
                vocab, device,
            )
        presence = to_device([p.presence_penalty for p in sub_params], device)
        frequency = to_device([p.frequency_penalty for p in sub_params], device)
        if len(pen) == n:
            logits = apply_penalties(logits, prompts, outputs, presence, frequency, repetition)
        else:
            idx = to_device(pen, device)
            logits[idx] = apply_penalties(logits[idx], prompts, outputs, presence, frequency, repetition)

    # DRY (llama.cpp's): each such row's penalties found on the host in its history.
    dried = [(i, *llamacpp.dry_penalties(states[i].dry_window(prompt_token_ids[i], output_token_ids[i],
                                                              p.dry_penalty_last_n),
                                         states[i].dry_breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length))
             for i, p in enumerate(params) if p.dry]
    dried = [(i, t[t < vocab], v[t < vocab]) for i, t, v in dried if len(t)]
    if dried:
        rows = np.concatenate([np.full(len(t), i) for i, t, _ in dried])
        cols, vals = np.concatenate([t for _, t, _ in dried]), np.concatenate([v for *_, v in dried])
        logits.index_put_((to_device(torch.from_numpy(rows), device), to_device(torch.from_numpy(cols), device)),
                          to_device(torch.from_numpy(-vals).float(), device), accumulate=True)

    # Structured output, last: only the tokens that keep each such row's output inside its grammar. The masks go
    # to the device packed, as the grammars keep them (a bit a token, each state once), and are unpacked there:
    # 256 rows over a 151936-token vocabulary are 4.9 MB of bits, where bools were 39 MB to make and copy.
    ruled = [(i, s.grammar.info()) for i, s in enumerate(states) if s.grammar is not None]
    if ruled:
        uniq: dict[int, tuple[int, StateInfo]] = {}
        which = [uniq.setdefault(id(info), (len(uniq), info))[0] for _, info in ruled]
        packed = to_device(torch.from_numpy(np.stack([info.packed_mask for _, info in uniq.values()])), device)
        allow = unpack_bits(packed, vocab)
        if len(uniq) < len(ruled):
            allow = allow[to_device(which, device)]
        idx = to_device([i for i, _ in ruled], device)
        logits[idx] = logits[idx].masked_fill(~allow, -math.inf)
    # allowed_token_ids with bad words or a grammar can leave a row nothing: its one choice is then EOS (the
    # engine ends it: Engine._stop_reason). Only those rows are read: a grammar alone always leaves EOS.
    eos = [t for t in eos_token_ids if 0 <= t < vocab]
    narrowed = sorted({i for i, _ in allowed} & ({i for i, _ in banned} | {i for i, _ in ruled}))
    if narrowed and eos:
        idx, cols = to_device(narrowed, device).unsqueeze(1), to_device(eos, device).unsqueeze(0)
        dead = torch.isneginf(logits[idx.squeeze(1)]).all(dim=1, keepdim=True)
        logits[idx, cols] = torch.where(dead, 0.0, logits[idx, cols])
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_k: int = 0,
    every_row_has_k: bool = False,
) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p leave out, each row with its own k and p.

    top_k (n,) long, 0 = off; top_p (n,) float, >= 1 = off; ``max_k`` the largest k
    in ``top_k``; ``every_row_has_k`` says no row has top-k off (told by the caller,
    who knows it from the params, so the GPU need not be asked). top-p keeps the smallest prefix of the (top-k renormalised) sorted
    distribution whose mass reaches p, and always the most likely token, and the tokens tied with its last
    (``kernels.reference.top_p_cut``: ``kernels.sample_race``'s cut).

    Sorting all V logits is by far the dearest step on a CPU, so it is avoided when
    it can be: top-k alone masks by each row's k-th value from ``topk(max_k)`` (ties
    at the k-th value are kept), and top-p on a batch where every row has a top-k
    sorts only those ``max_k`` candidates. Only top-p on a row without top-k sorts V.
    """
    n, vocab = logits.shape
    if top_k is not None:
        max_k = min(max_k, vocab) if max_k > 0 else vocab
    if top_p is None:
        if top_k is None:
            return logits
        top_vals = logits.topk(max_k, dim=-1).values  # (n, max_k), descending
        kth = top_vals.gather(1, (top_k.clamp(1, max_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k <= 0).unsqueeze(1), -math.inf)  # rows without top-k keep all
        return logits.masked_fill(logits < kth, -math.inf)

    if top_k is not None and every_row_has_k and max_k < vocab:
        sorted_logits = logits.topk(max_k, dim=-1).values  # (n, max_k): the candidates
        kth = sorted_logits.gather(1, (top_k.clamp(1, max_k) - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
        # top-k keeps the tokens tied with the k-th that topk left out too: their mass counts in top-p's
        # distribution, and where top-p keeps the k-th value they stay (as the sort below and the race keep them)
        left_out = (logits == kth).sum(dim=1, keepdim=True) - (sorted_logits == kth).sum(dim=1, keepdim=True)
        top = sorted_logits[:, :1]
        kept = (sorted_logits - top).exp().sum(dim=1, keepdim=True)
        probs = sorted_logits.softmax(dim=-1) * (kept / (kept + left_out * (kth - top).exp()))
        least = sorted_logits.masked_fill(reference.top_p_cut(probs, top_p), math.inf).amin(dim=1, keepdim=True)
        return logits.masked_fill(logits < torch.maximum(least, kth), -math.inf)  # (kth: top-p may keep all)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (n, V)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    sorted_logits.masked_fill_(reference.top_p_cut(sorted_logits.softmax(dim=-1), top_p), -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    Done in log space (``logit < max_logit + log(min_p)``), so no softmax is needed;
    ratios of probabilities do not change with renormalisation, so this is the same
    whether it runs before or after top-k / top-p. ``min_p == 0`` masks nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.to(logits.dtype)).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -math.inf)


# ----------------------------------------------------------------------------- sampler


class Sampler:
    """Picks one token per row; called by the engine once per step."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device | str, seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        # Unseeded rows share this generator, one batched draw per step.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)

    def __call__(self, *args, **kwargs) -> SamplerOutput:
        """``sample``, waiting for its result."""
        return self.sample(*args, **kwargs).result()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        states: list[SamplingState],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        num_output_tokens: list[int] | None = None,
        in_flight: Callable[[list[int]], torch.Tensor] | None = None,
    ) -> Sampled:
        """The step's ids (and logprobs) on the device, without waiting for them: ``Sampled.result()``
        is the host sync. ``num_output_tokens``: how many tokens each row has sampled before this one,
        when more than its ``output_token_ids`` hold (asynchronous scheduling: a token still in flight);
        min_tokens and the seeded noise count them, penalties read the lists and ``in_flight``'s tokens."""
        if logits.shape[-1] > self.vocab_size:  # padded lm_head columns are not tokens
            logits = logits[:, :self.vocab_size]
        if num_output_tokens is None:
            num_output_tokens = [len(out) for out in output_token_ids]

        some, every = _kinds(states)
        # min_tokens past in every row (its stop ids no longer banned)
        late = not (some & _MIN_TOKENS) or all(m >= p.min_tokens for p, m in zip(params, num_output_tokens, strict=True))
        # Fast path: the common benchmark batch, all greedy with nothing to process.
        if every & _GREEDY and every & _PLAIN and not (some & _LOGPROBS) and late:
            return Sampled(greedy_ids(logits))

        raw = logits
        # (nothing to process: the model's logits as they are, read, never written; the temperature's division
        # makes float32 ones, and the race reads any dtype)
        if not (every & _PLAIN and late):
            logits = process_logits(logits, params, states, prompt_token_ids, output_token_ids, self.eos_token_ids,
                                    num_output_tokens, in_flight)
        mirostat = None
        if not (some & _GREEDY):
            ids, mirostat = self._sample(logits, params, states, num_output_tokens)
        else:
            ids = greedy_ids(logits)
            if not (every & _GREEDY):
                rand = [i for i, s in enumerate(states) if not s.greedy]
                idx = to_device(rand, logits.device)
                ids[idx], mirostat = self._sample(logits[idx], [params[i] for i in rand], [states[i] for i in rand],
                                                  [num_output_tokens[i] for i in rand])

        if not (some & _LOGPROBS):
            return Sampled(ids, None, mirostat)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        k = max(params[i].logprobs for i in lp_rows)
        if len(lp_rows) == len(params):
            tensors = logprob_tensors(raw, ids, k)
        else:
            idx = to_device(lp_rows, logits.device)
            tensors = logprob_tensors(raw[idx], ids[idx], k)
        return Sampled(ids, (lp_rows, [params[i].logprobs for i in lp_rows], tensors), mirostat)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], states: list[SamplingState],
                num_output_tokens: list[int]) -> tuple[torch.Tensor, tuple[list[SamplingState], torch.Tensor] | None]:
        """Temperature, the truncations, then the exponential race; all rows non-greedy. Also the mirostat rows'
        states and next targets (None without such rows)."""
        n, vocab = logits.shape
        device = logits.device
        some, every = _kinds(states)
        if some & _LLAMACPP and not every & _LLAMACPP and kernels.races(device):
            # the rows of llama.cpp's samplers on the torch path, which sorts each row, the others raced: a step
            # with one such row does not sort them all
            ids = torch.empty(n, dtype=torch.int64, device=device)
            mirostat = None
            for llamacpp_rows in (False, True):
                rows = [i for i, s in enumerate(states) if s.llamacpp is llamacpp_rows]
                idx = to_device(rows, device)
                ids[idx], mirostat = self._sample(logits[idx], [params[i] for i in rows], [states[i] for i in rows],
                                                  [num_output_tokens[i] for i in rows])
            return ids, mirostat
        # One host-to-device copy for all four per-row knobs (SamplingState.knobs); what the step needs of
        # them read on the host copy (a few operators, not a pass over the rows each)
        host = torch.frombuffer(bytearray(b"".join([s.knobs for s in states])), dtype=torch.float32).view(n, 4)
        knobs = to_device(host, device)  # (n, 4)
        max_k = int(host[:, 1].max()) if some & _TOP_K else 0
        use_p, every_row_has_k = bool(some & _TOP_P), bool(every & _TOP_K)
        # llama.cpp's rows (most steps: none)
        extra = [(i, params[i]) for i, s in enumerate(states) if s.llamacpp] if some & _LLAMACPP else []
        if not extra and kernels.races(device):  # (no sort: one kernel reads each row a few times)
            keys = self._keys(states, num_output_tokens, device, seeded=bool(some & _SEEDED))
            return kernels.sample_race(logits, knobs[:, 0].contiguous(), knobs[:, 1].long(), knobs[:, 2].contiguous(),
                                       knobs[:, 3].contiguous(), keys, max_k), None
        logits = logits / knobs[:, 0:1]
        logits = _on_rows(logits, [(i, p.top_n_sigma) for i, p in extra if p.top_n_sigma > 0 and not p.mirostat],
                          llamacpp.apply_top_n_sigma)
        typical = [(i, p.typical_p) for i, p in extra if p.typical_p < 1.0 and not p.mirostat]
        if max_k > 0 or (use_p and not typical):
            logits = apply_top_k_top_p(
                logits,
                knobs[:, 1].long() if max_k > 0 else None,
                knobs[:, 2] if use_p and not typical else None,
                max_k,
                every_row_has_k=every_row_has_k,
            )
        if typical:  # between top-k and top-p, as in llama.cpp
            logits = _on_rows(logits, typical, llamacpp.apply_typical)
            if use_p:
                logits = apply_top_k_top_p(logits, None, knobs[:, 2])
        if some & _MIN_P:
            logits = apply_min_p(logits, knobs[:, 3])
        xtc = [(i, p.xtc_threshold, p.xtc_probability) for i, p in extra if p.xtc and not p.mirostat]
        if xtc:
            chance = self._uniforms([states[i] for i, *_ in xtc], [num_output_tokens[i] for i, *_ in xtc], device)
            logits = _on_rows(logits, xtc, lambda x, threshold, p: llamacpp.apply_xtc(x, threshold, chance <= p))
        dyn = [(i, p.temperature, p.dynatemp_range, p.dynatemp_exponent) for i, p in extra
               if p.dynatemp_range > 0 and not p.mirostat]
        logits = _on_rows(logits, dyn, llamacpp.apply_dynamic_temperature)
        miro = [i for i, p in extra if p.mirostat]
        for version in (1, 2):
            rows = [(i, states[i].mu) for i in miro if params[i].mirostat == version]
            logits = _on_rows(logits, rows, lambda x, mu, v=version: llamacpp.apply_mirostat(x, mu, v, vocab))
        probs = logits.softmax(dim=-1)
        ids = probs.div_(self._noise(n, vocab, states, num_output_tokens, device)).argmax(dim=-1)
        if not miro:
            return ids, None
        idx = to_device(miro, device)
        knobs = to_device([[states[i].mu, params[i].mirostat_tau, params[i].mirostat_eta] for i in miro], device,
                          torch.float32)
        mu = llamacpp.mirostat_mu(logits[idx], ids[idx], knobs[:, 0], knobs[:, 1], knobs[:, 2])
        return ids, ([states[i] for i in miro], mu)

    def _keys(self, states: list[SamplingState], num_output_tokens: list[int], device: torch.device,
              seeded: bool = True) -> torch.Tensor:
        """(n, 2) int64 keys of each row's race (``kernels.sample_race``): a seeded row's from its seed and token count,
        so that its draws are ``_noise``'s; the others' from the engine's generator. (``seeded`` False: no row is.)"""
        rows, seeded_keys = _seeded_keys(states, num_output_tokens, device) if seeded else ([], None)
        if rows and len(rows) == len(states):  # (as _noise: the generator draws for none)
            return seeded_keys
        keys = torch.randint(0, 1 << 32, (len(states), 2), generator=self.generator, device=device)
        if rows:
            keys[to_device(rows, device)] = seeded_keys
        return keys

    def _uniforms(self, states: list[SamplingState], num_output_tokens: list[int],
                  device: torch.device) -> torch.Tensor:
        """A uniform in [0, 1) per row (XTC's draw): a seeded row's from its seed and token count (the same on
        every device and in any batch), the rest from the engine's generator."""
        out = torch.rand(len(states), generator=self.generator, device=device)
        seeded = [j for j, s in enumerate(states) if s.seed is not None]
        if seeded:
            seeds = np.array([states[j].seed for j in seeded], dtype=np.uint64)
            counts = np.array([num_output_tokens[j] for j in seeded], dtype=np.uint64)
            k = _splitmix64(_splitmix64(seeds ^ np.uint64(_XTC_SALT)) ^ counts)
            u = (k >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)  # (24 bits: exact)
            out[to_device(seeded, device)] = to_device(torch.from_numpy(u), device)
        return out

    def _noise(self, n: int, vocab: int, states: list[SamplingState], num_output_tokens: list[int],
               device: torch.device) -> torch.Tensor:
        """Exp(1) noise (n, V): seeded rows from their hash (``kernels.reference.exponentials``), the rest in one
        draw from the engine's generator."""
        seeded, keys = _seeded_keys(states, num_output_tokens, device)
        if not seeded:
            return self._exponentials(n, vocab, device)
        if len(seeded) == n:
            return reference.exponentials(keys, vocab)
        unseeded = [j for j, s in enumerate(states) if s.seed is None]
        q = torch.empty((n, vocab), device=device)
        q[to_device(unseeded, device)] = self._exponentials(len(unseeded), vocab, device)
        q[to_device(seeded, device)] = reference.exponentials(keys, vocab)
        return q

    def _exponentials(self, n: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise (n, V) from the engine's generator, drawn as ``-log(u)`` with ``u ~ U[tiny, 1)``:
        the same distribution as ``exponential_`` but several times cheaper on a CPU, and never exactly 0
        (a zero would make a masked token's 0/0 = NaN win the argmax)."""
        u = torch.empty((n, vocab), device=device).uniform_(generator=self.generator)
        return u.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()


def _kinds(states: list[SamplingState]) -> tuple[int, int]:
    """The bits of ``SamplingState.kind`` that some row has, and those that every row has."""
    some, every = 0, _EVERY_KIND
    for kind in {s.kind for s in states}:  # (a few distinct values)
        some, every = some | kind, every & kind
    return some, every


def _on_rows(logits: torch.Tensor, rows: list[tuple], fn) -> torch.Tensor:
    """``fn`` applied to the rows of ``logits`` named by ``rows`` (row index, then each one's values of
    ``fn``'s further arguments); the logits as they were where ``rows`` is empty."""
    if not rows:
        return logits
    idx = to_device([r[0] for r in rows], logits.device)
    args = to_device([r[1:] for r in rows], logits.device, torch.float32).unbind(1)
    if len(rows) == len(logits):
        return fn(logits, *args)
    logits = logits.clone()
    logits[idx] = fn(logits[idx], *args)
    return logits


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 lane (numpy's uint64 arithmetic wraps modulo 2**64, as the spec's)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _seeded_keys(states: list[SamplingState], num_output_tokens: list[int],
                 device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """The seeded rows, and their (rows, 2) noise keys on ``device`` (``_row_keys``; None without such rows)."""
    seeded = [j for j, s in enumerate(states) if s.seed is not None]
    if not seeded:
        return seeded, None
    return seeded, to_device(_row_keys([states[j].seed for j in seeded], [num_output_tokens[j] for j in seeded]),
                             device)


def _row_keys(seeds: list[int], indices: list[int]) -> torch.Tensor:
    """(n, 2) int64: two 32-bit keys for the ``indices[j]``-th token a request with ``seeds[j]`` samples,
    ``splitmix64(seed ^ splitmix64(index))`` split in halves (host-side, exact; in numpy: a step's rows at once)."""
    k = _splitmix64(np.array(seeds, dtype=np.uint64) ^ _splitmix64(np.array(indices, dtype=np.uint64)))
    return torch.from_numpy(np.stack([k & np.uint64(_MASK32), k >> np.uint64(32)], axis=1).astype(np.int64))
