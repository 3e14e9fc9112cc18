"""`ferry generate`: offline generation for one prompt, in one process, through the worker's own
boot and step executor — the same code a served request runs, with a minimal scheduler loop
(one request: pages handed out in order, linear-state slot 1, prompt prefilled in chunks of at
most --max-prefill-tokens, then one decode step per token). The request is built here, so its
sampling parameters are checked here (shared/sampling.py's rules)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ferry.services.worker.expert_cache_delta import report_delta, step_figures
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
from ferry.shared.eos import eos_token_ids
from ferry.shared.errors import ConfigError
from ferry.shared.logging import add_log_flags, configure_logging
from ferry.shared.model_flag import require_model
from ferry.shared.sampling import SamplingParams, sampling_problems
from ferry.shared.step import NewRequest, StepBatch
from ferry.shared.units import ceil_div

REQ_ID = 1
LINEAR_STATE_SLOT = 1  # slot 0 is the padding slot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized as is, no chat template)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    add_worker_flags(parser, positional_model=True)
    add_log_flags(parser)


def _load_tokenizer(model_dir: Path):
    """The model's tokenizer (a GGUF file's from its metadata), None for a directory without tokenizer files."""
    from ferry.shared.tokenizer_source import load_tokenizer

    if model_dir.is_dir() and not (
        (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()
    ):
        return None
    return load_tokenizer(model_dir)


def _prompt_ids(args, tokenizer, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as exc:
            raise ConfigError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from exc
    else:
        if tokenizer is None:
            raise ConfigError("the model has no tokenizer files: give --prompt-ids instead of --prompt")
        ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    return ids


class OneRequestScheduler:
    """Hands out KV pages to one request in order and builds its steps (page 0 is the sentinel)."""

    def __init__(self, page_size: int, pages: int, max_step_tokens: int):
        self.page_size, self.pages, self.max_step_tokens = page_size, pages, max_step_tokens
        self.step_id = 0

    def capacity(self) -> int:
        return self.pages * self.page_size

    def step(self, tokens: list[int], context: int, sample: bool, new: tuple[NewRequest, ...]) -> StepBatch:
        pages_needed = ceil_div(context + len(tokens), self.page_size)
        self.step_id += 1
        return StepBatch(
            step_id=self.step_id,
            req_ids=np.array([REQ_ID], dtype=np.int64),
            tokens=np.array(tokens, dtype=np.int32),
            query_lens=np.array([len(tokens)], dtype=np.int32),
            context_lens=np.array([context], dtype=np.int32),
            page_table=np.arange(1, pages_needed + 1, dtype=np.int32)[None, :],
            linear_state_slots=np.array([LINEAR_STATE_SLOT], dtype=np.int32),
            reset_linear_state=np.array([context == 0]),
            sample=np.array([sample]),
            new_requests=new,
        )


def generate(
    executor, prompt_ids: list[int], params: SamplingParams, max_tokens: int, eos_ids: tuple[int, ...]
) -> tuple[list[int], list[float], str]:
    """Run the request to completion; (generated token ids, their logprobs, finish reason: stop | length)."""
    plan = executor.plan
    scheduler = OneRequestScheduler(plan.kv.page_size, plan.kv.pages, plan.max_prefill_tokens)
    limit = min(plan.max_model_len, scheduler.capacity())
    if len(prompt_ids) >= limit:
        raise ConfigError(
            f"the prompt has {len(prompt_ids)} tokens; this plan holds at most {limit - 1} "
            "(raise --max-model-len or the KV pool)"
        )
    new = (NewRequest(req_id=REQ_ID, prompt_token_ids=np.array(prompt_ids, dtype=np.int32), sampling=params),)
    context, output, logprobs = 0, [], []
    chunk = plan.max_prefill_tokens
    while context < len(prompt_ids):  # prefill, in chunks
        part = prompt_ids[context : context + chunk]
        last = context + len(part) == len(prompt_ids)
        result = executor.execute(scheduler.step(part, context, last, new))
        new, context = (), context + len(part)
    while True:
        token = int(result.token_ids[0])
        output.append(token)
        logprobs.append(float(result.logprobs[0]))
        if token in eos_ids and not params.ignore_eos or token in params.stop_token_ids:
            reason = "stop"
            break
        if len(output) >= max_tokens or context + 1 >= limit:
            reason = "length"
            break
        result = executor.execute(scheduler.step([token], context, True, ()))
        context += 1
    executor.execute(StepBatch.empty(step_id=scheduler.step_id + 1, finished_req_ids=(REQ_ID,)))
    return output, logprobs, reason


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling parameters, checked before anything boots."""
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        ignore_eos=args.ignore_eos,
    )
    problems = sampling_problems(params)
    if problems:
        raise ConfigError(
            "; ".join("--" + p.replace("_", "-", p.split()[0].count("_")) for p in problems)
        )  # flag names
    return params


class StepRecordingExecutor:
    """The executor, recording the expert cache's figures of every step that ran a forward."""

    def __init__(self, executor):
        self.executor, self.plan, self.spec = executor, executor.plan, executor.spec
        self.before = executor.expert_cache_report()
        self.steps: list[dict] = []

    def execute(self, batch: StepBatch):
        output = self.executor.execute(batch)
        if len(batch.req_ids):
            self.steps.append(step_figures(self.executor.expert_cache_report()))
        return output

    def expert_cache(self) -> dict:
        """Cumulative over the steps run through this wrapper, with the per-step figures."""
        return {**report_delta(self.before, self.executor.expert_cache_report()), "per_step": self.steps}


def run(args: argparse.Namespace) -> int:
    from ferry.services.worker.boot import boot_worker
    from ferry.services.worker.model_source import resolve_model_dir

    if (args.speculative_method or "off") != "off":  # a planner flag it shares with serve; its loop never drafts
        raise ConfigError(
            f"--speculative-method {args.speculative_method}: ferry generate decodes one token a step; drop the flag "
            "(ferry serve speculates)"
        )
    args.model = require_model(args, "generate")
    model_dir = resolve_model_dir(args.model, args.revision)  # a missing model fails before the boot
    params = _sampling_params(args)
    # the boot's log lines (the plan, the CPU budget's origin) go to stderr; stdout stays the result
    configure_logging("generate", args.log_level, args.log_format)
    executor, plan = boot_worker(boot_config_from_args(args))
    recording = StepRecordingExecutor(executor)
    tokenizer = _load_tokenizer(model_dir)
    prompt_ids = _prompt_ids(args, tokenizer, executor.spec.vocab_size)
    eos_ids = eos_token_ids(model_dir, tokenizer)  # the same ids the api stops on
    token_ids, logprobs, reason = generate(recording, prompt_ids, params, args.max_tokens, eos_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        out = {
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "logprobs": logprobs,
            "text": text,
            "finish_reason": reason,
            "plan": plan.to_dict(),
            "expert_cache": recording.expert_cache(),
        }
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        print(text if text is not None else ",".join(map(str, token_ids)))
    return 0
