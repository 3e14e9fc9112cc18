"""Grammar-constrained sampling on the worker: one llguidance matcher per request that carries a grammar.

The api turns a request's `response_format` or forced tool call into an llguidance grammar and checks
that it compiles (services/api/structured.py); the grammar travels in SamplingParams.grammar. Here, per
step, the matchers of the rows that have one write their allowed-token bitmasks on the host (in
parallel, llguidance's own thread pool) into pinned memory, which crosses to the device without a wait
and becomes a -inf mask on those rows' logits; after the step each matcher consumes its sampled token.
Rows without a grammar cost nothing. Once a grammar is complete only end-of-sequence tokens are allowed,
so the request stops as any other does. A matcher in its error state (the grammar broke down: a parser
limit, a schema matched by no finite value) allows only those too, so the row samples a harmless token,
and the step reports the request as failed (`failure`): it ends with an error, never as if complete.

llguidance needs the model's tokenizer (built once, on the first request with a grammar: about a
second for a 150k vocabulary). Compiling a matcher runs on the step thread (0.2 s for a large
schema), so the last few grammars' pristine matchers are kept and a request with the same grammar
gets a `deep_copy` of one: the n choices of one request (n separate requests here, one grammar)
compile it once, not n times.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("worker.grammar")

PRISTINE_MATCHERS = 16  # grammars whose freshly compiled matcher is kept for the next request with it
MAX_FAILURE_CHARS = 500  # of a dead matcher's error, in the request's error


def tokenizer_factory(model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Callable[[], object]:
    """A function building the llguidance tokenizer of `model_dir` (called on first use)."""

    def build():
        import llguidance.hf

        from ferry.shared.tokenizer_source import load_tokenizer

        hf = load_tokenizer(model_dir)
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    return build


class GrammarSet:
    """The matchers of the requests with a grammar, and the bitmask they fill."""

    def __init__(self, tokenizer: Callable[[], object] | None, vocab_size: int, device: torch.device):
        self._tokenizer_factory = tokenizer
        self._tokenizer = None
        self._executor = None
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._bits: torch.Tensor | None = (
            None  # made on first use: a worker that never sees a grammar allocates nothing
        )
        self._pristine: OrderedDict[str, object] = OrderedDict()  # grammar text -> a matcher that consumed nothing

    def matcher(self, grammar: str):
        import llguidance

        if self._tokenizer is None:
            if self._tokenizer_factory is None:
                raise RuntimeError("a request carries a grammar but this worker has no tokenizer for it")
            self._tokenizer = self._tokenizer_factory()
            self._executor = llguidance.LLExecutor()
        pristine = self._pristine.get(grammar)
        if pristine is not None:
            self._pristine.move_to_end(grammar)
            return pristine.deep_copy()
        m = llguidance.LLMatcher(self._tokenizer, grammar)
        if m.is_error():
            log.warning("grammar_error", error=m.get_error())
            return m
        self._pristine[grammar] = m.deep_copy()
        if len(self._pristine) > PRISTINE_MATCHERS:
            self._pristine.popitem(last=False)
        return m

    def eos_ids(self) -> list[int]:
        return list(self._tokenizer.eos_tokens) if self._tokenizer is not None else []

    def masks(self, matchers: list) -> torch.Tensor:
        """int32 [len(matchers), words] bitmasks on the device (copied from pinned memory, no wait)."""
        host = torch.zeros((len(matchers), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        ok = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
        if ok:
            self._executor.unsafe_compute_mask_ptr(ok, host.data_ptr(), self.words * 4, len(matchers))
        for i, m in enumerate(matchers):
            if m.is_error():  # a grammar that broke down: nothing but the end of the sequence
                for eos in self.eos_ids():
                    host[i, eos // 32] |= _bit(eos % 32)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """`logits` [n, V] with every token the masks leave out at -inf (a new tensor)."""
        n, vocab = logits.shape
        if self._bits is None:
            self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        allowed = ((masks.unsqueeze(-1) >> self._bits) & 1).view(n, -1)[:, :vocab].bool()
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer's vocabulary: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        return logits.masked_fill(~allowed, float("-inf"))


def failure(matcher) -> str | None:
    """Why `matcher` allows no way on (the first line of llguidance's error, clipped: the lines after
    it dump the parser's state), or None while it works."""
    if not matcher.is_error():
        return None
    error = matcher.get_error().strip().split("\n", 1)[0]
    return error if len(error) <= MAX_FAILURE_CHARS else error[:MAX_FAILURE_CHARS] + "..."


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
