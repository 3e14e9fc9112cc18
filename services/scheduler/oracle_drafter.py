"""Benchmark-only drafts of a set acceptance rate (bench/speculation_oracle.py): the target's own greedy
continuation, each token corrupted at rate 1 - alpha, so a verify keeps a draft with chance alpha given the ones
before it were. Speculation's speed at a known acceptance, apart from how well prompt lookup guesses.

Two switches, read from the scheduler's environment at start and honoured only with FERRY_BENCH_ONLY=1 (never a
request field: a served request cannot reach them):
* FERRY_BENCH_RECORD_SEQUENCES=PATH: each finished request's prompt and output tokens are appended to PATH
  (JSON lines {"prompt": [...], "output": [...]}); the bench records a run with speculation off;
* FERRY_BENCH_ORACLE_DRAFTS=PATH (with --speculative-method ngram or mtp: with mtp the worker still drafts, its
  full cost paid, and the oracle's tokens replace its drafts): a request whose prompt PATH records, and whose
  output so far follows the recorded one, is drafted the recorded tokens after it, corrupted at rate
  1 - FERRY_BENCH_ORACLE_ALPHA (default 1); any other request gets no drafts;
* FERRY_BENCH_PINNED_DRAFTS=k (with --speculative-method ngram or mtp): every drafting row is given min(k,
  --speculative-tokens) drafts, whatever the draft-length controller would choose: what a fixed k yields, beside
  what the controller makes of the same acceptance.
No torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ferry.services.scheduler.request import Request
from ferry.shared.errors import ConfigError
from ferry.shared.speculation import MAX_SPECULATIVE_TOKENS

BENCH_ENV = "FERRY_BENCH_ONLY"
RECORD_ENV = "FERRY_BENCH_RECORD_SEQUENCES"
ORACLE_ENV = "FERRY_BENCH_ORACLE_DRAFTS"
ALPHA_ENV = "FERRY_BENCH_ORACLE_ALPHA"
PINNED_ENV = "FERRY_BENCH_PINNED_DRAFTS"


@dataclass(frozen=True)
class BenchDrafts:
    """The bench switches, checked: where to record finished sequences, where the oracle's come from, its alpha."""

    record_path: str | None = None
    oracle_path: str | None = None
    alpha: float = 1.0
    pinned_drafts: int = 0  # > 0: every drafting row's k (draft_length.DraftLength.pinned)


def bench_drafts_from_env(environ: Mapping[str, str], speculative_method: str) -> BenchDrafts:
    """The bench switches of `environ`, or ConfigError naming the variable (or flag) to change."""
    record, oracle, alpha = environ.get(RECORD_ENV), environ.get(ORACLE_ENV), environ.get(ALPHA_ENV)
    pinned = environ.get(PINNED_ENV)
    switches = ((RECORD_ENV, record), (ORACLE_ENV, oracle), (ALPHA_ENV, alpha), (PINNED_ENV, pinned))
    named = [name for name, v in switches if v]
    if not named:
        return BenchDrafts()
    if environ.get(BENCH_ENV) != "1":
        raise ConfigError(
            f"{', '.join(named)}: benchmark-only switches (bench/speculation_oracle.py), honoured only with "
            f"{BENCH_ENV}=1; unset them to serve"
        )
    if alpha and not oracle:
        raise ConfigError(f"{ALPHA_ENV} is the oracle's acceptance rate: set {ORACLE_ENV} too, or unset it")
    try:
        rate = float(alpha) if alpha else 1.0
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"{ALPHA_ENV} must be a number between 0 and 1, got {alpha!r}")
    if oracle:
        if speculative_method == "off":
            raise ConfigError(
                f"{ORACLE_ENV} drafts for speculative decoding: serve with --speculative-method ngram or mtp"
            )
        if not Path(oracle).is_file():
            raise ConfigError(f"{ORACLE_ENV}={oracle!r}: no such file (record one with {RECORD_ENV})")
    drafts = int(pinned) if pinned and pinned.strip().isdigit() else -1
    if pinned and not 1 <= drafts <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{PINNED_ENV} must be a whole number from 1 to {MAX_SPECULATIVE_TOKENS}, got {pinned!r}")
    if pinned and speculative_method == "off":
        raise ConfigError(f"{PINNED_ENV} fixes the drafts a row carries: serve with --speculative-method ngram or mtp")
    return BenchDrafts(record_path=record or None, oracle_path=oracle or None, alpha=rate, pinned_drafts=max(drafts, 0))


def record_sequence(path: str, req: Request) -> None:
    """Append req's prompt and output tokens to `path` (a finished request)."""
    line = json.dumps({"prompt": req.tokens[: req.prompt_len], "output": req.tokens[req.prompt_len :]})
    with open(path, "a") as f:
        f.write(line + "\n")


class OracleDrafter:
    """Drafts from recorded greedy continuations, corrupted at rate 1 - alpha (a BatchScheduler drafter)."""

    def __init__(self, sequences: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int, seed: int = 0):
        self.sequences = sequences  # prompt -> its recorded output
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def read(path: str) -> dict[tuple[int, ...], list[int]]:
        """The sequences record_sequence wrote to `path`: prompt -> output; ConfigError if it holds none such."""
        sequences = {}
        try:
            for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
                if line.strip():
                    row = json.loads(line)
                    sequences[tuple(int(t) for t in row["prompt"])] = [int(t) for t in row["output"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{ORACLE_ENV}={path!r}: not a file of recorded sequences ({exc})") from exc
        return sequences

    def __call__(self, req: Request, k: int) -> list[int]:
        recorded = self.sequences.get(tuple(req.tokens[: req.prompt_len]))
        done = len(req.tokens) - req.prompt_len
        if recorded is None or recorded[:done] != req.tokens[req.prompt_len :]:
            return []  # not recorded, or off the recorded path (sampled): no oracle knows its continuation
        drafts = recorded[done : done + k]
        for i, t in enumerate(drafts):
            if self.rng.random() >= self.alpha:  # corrupted: any other token
                shift = 1 + int(self.rng.integers(max(self.vocab_size - 1, 1)))
                drafts[i] = (t + shift) % self.vocab_size if self.vocab_size else t + shift
        return drafts
