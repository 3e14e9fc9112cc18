"""The sampler: filters never leak, seeds reproduce, penalties follow their formulas exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.services.worker.sampler import Sampler, apply_penalties, filter_logits
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest

V = 50


def make_sampler(params_by_id: dict[int, SamplingParams], prompts: dict[int, list[int]] | None = None, seed=0):
    sampler = Sampler(V, "cpu", seed=seed)
    for rid, params in params_by_id.items():
        prompt = np.array((prompts or {}).get(rid, [1, 2, 3]), dtype=np.int32)
        sampler.add_request(NewRequest(req_id=rid, prompt_token_ids=prompt, sampling=params))
    return sampler


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_its_logprob():
    logits = random_logits(4)
    sampler = make_sampler({i: SamplingParams(temperature=0.0) for i in range(4)})
    tokens, logprobs = sampler.sample([0, 1, 2, 3], logits)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    assert sampler.requests[2].output_token_ids == [int(tokens[2])]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=8, top_p=0.5, min_p=0.05, temperature=0.7),
    ],
)
def test_filters_never_sample_outside_the_allowed_set(params):
    logits = random_logits(1, seed=3)
    allowed = torch.isfinite(filter_logits(logits / params.temperature, [params]))[0]
    assert 1 <= int(allowed.sum()) < V
    sampler = make_sampler({0: params})
    seen = set()
    for _ in range(400):
        token, logprob = sampler.sample([0], logits)
        seen.add(int(token))
        assert allowed[int(token)] and torch.isfinite(logprob).all()
    # and it is a real draw over the allowed set, not always the top token
    assert len(seen) == int(allowed.sum()) or len(seen) >= 3


def test_filter_masks_match_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = random_logits(3, seed=7)
    for warper, params in [
        (TopKLogitsWarper(7), SamplingParams(top_k=7)),
        (TopPLogitsWarper(0.6), SamplingParams(top_p=0.6)),
        (MinPLogitsWarper(0.1), SamplingParams(min_p=0.1)),
    ]:
        ours = filter_logits(logits.clone(), [params] * 3)
        theirs = warper(None, logits.clone())
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), warper


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    sampler = make_sampler({0: SamplingParams(temperature=1.0)}, seed=123)
    counts = np.bincount([int(sampler.sample([0], logits)[0]) for _ in range(3000)], minlength=V)
    assert np.allclose(counts[:3] / 3000, [0.5, 0.3, 0.2], atol=0.04)


def test_same_seed_same_tokens_whatever_the_batch():
    logits = random_logits(3, seed=11)
    a = make_sampler({7: SamplingParams(seed=42)}, seed=1)
    b = make_sampler({5: SamplingParams(), 7: SamplingParams(seed=42), 9: SamplingParams(seed=3)}, seed=2)
    tokens_a = [int(a.sample([7], logits[1:2])[0][0]) for _ in range(30)]
    tokens_b = [int(b.sample([5, 7, 9], logits)[0][1]) for _ in range(30)]
    assert tokens_a == tokens_b
    c = make_sampler({7: SamplingParams(seed=43)})
    assert [int(c.sample([7], logits[1:2])[0][0]) for _ in range(30)] != tokens_a


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits(1, seed=5)
    prompt = [1, 4, 9, 4]
    sampler = make_sampler({0: SamplingParams(temperature=0.0, repetition_penalty=1.7)}, prompts={0: prompt})
    for token in (12, 30):
        sampler.requests[0].record(token)
    ours = apply_penalties(logits, [sampler.requests[0]], V)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + [12, 30]]), logits.clone())
    assert torch.allclose(ours, theirs)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = random_logits(2, seed=9)
    sampler = make_sampler(
        {0: SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 1: SamplingParams()},
        prompts={0: [3, 3, 3], 1: [3]},
    )
    for token in (7, 7, 7, 2):
        sampler.requests[0].record(token)
    out = apply_penalties(logits, [sampler.requests[0], sampler.requests[1]], V)
    expected = logits.clone()
    expected[0, 7] -= 0.5 + 3 * 0.25
    expected[0, 2] -= 0.5 + 1 * 0.25
    # prompt tokens (3) are not penalised by presence/frequency; row 1 is untouched
    assert torch.allclose(out, expected)


def test_penalties_steer_greedy_away_from_repeats():
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 5] = 2.0, 1.5
    sampler = make_sampler({0: SamplingParams(temperature=0.0, frequency_penalty=1.0)})
    assert [int(sampler.sample([0], logits)[0]) for _ in range(3)] == [4, 5, 4]


def test_finished_requests_are_forgotten():
    sampler = make_sampler({0: SamplingParams(), 1: SamplingParams()})
    sampler.remove_request(0)
    with pytest.raises(KeyError, match="never registered"):
        sampler.sample([0], random_logits(1))
    assert sampler.sample([1], random_logits(1))[0].shape == (1,)


def test_combined_filters_match_transformers_warpers_in_sequence():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = random_logits(4, seed=21)
    params = SamplingParams(top_k=12, top_p=0.7, min_p=0.15)
    theirs = logits.clone()
    for warper in (TopKLogitsWarper(12), TopPLogitsWarper(0.7), MinPLogitsWarper(0.15)):
        theirs = warper(None, theirs)
    ours = filter_logits(logits.clone(), [params] * 4)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def test_rows_mix_greedy_and_sampled_with_their_own_filters():
    logits = random_logits(3, seed=4)
    sampler = make_sampler({0: SamplingParams(temperature=0.0), 1: SamplingParams(top_k=1), 2: SamplingParams(top_k=3)})
    top3 = logits[2].topk(3).indices.tolist()
    for _ in range(50):
        tokens, logprobs = sampler.sample([0, 1, 2], logits)
        assert int(tokens[0]) == int(logits[0].argmax())
        assert int(tokens[1]) == int(logits[1].argmax()) and abs(float(logprobs[1])) < 1e-6  # top-1: certain
        assert int(tokens[2]) in top3


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(min_p=1.5),
        dict(top_k=-2),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3.0),
        dict(temperature=float("nan")),
    ],
)
def test_the_sampling_rules_name_each_meaningless_parameter(bad):
    from ferry.shared.sampling import sampling_problems

    (problem,) = sampling_problems(SamplingParams(**bad))
    assert problem.startswith(next(iter(bad)))
    assert sampling_problems(SamplingParams()) == []


# ---- issue 11: logit_bias, top logprobs, grammar masks -----------------------------------------------


def test_logit_bias_moves_only_the_rows_that_ask():
    logits = random_logits(2)
    sampler = make_sampler(
        {0: SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), 1: SamplingParams(temperature=0.0)}
    )
    tokens, _ = sampler.sample([0, 1], logits)
    assert tokens.tolist() == [7, int(logits[1].argmax())]


def test_top_logprobs_are_the_models_own_and_none_when_no_row_asks():
    logits = random_logits(3)
    sampler = make_sampler(
        {
            0: SamplingParams(temperature=0.0, logprobs=4),
            1: SamplingParams(temperature=0.0),
            2: SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        }
    )
    tokens, _ = sampler.choose([0, 1, 2], logits)
    rows, token_lps, top_ids, top_lps = sampler.top_logprobs([0, 1, 2], logits, tokens)
    assert rows == [0, 2] and top_ids.shape == (2, 4)
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.equal(top_lps, ref[[0, 2]].topk(4).values)
    assert token_lps[0] == top_lps[0, 0]  # greedy without penalties: the top entry, exactly
    assert torch.allclose(token_lps, ref[[0, 2]].gather(1, tokens[[0, 2]][:, None]).squeeze(1))
    plain = make_sampler({0: SamplingParams(temperature=0.0)})
    assert plain.top_logprobs([0], logits[:1], logits[:1].argmax(-1)) is None


class _Matcher:
    """A stand-in llguidance matcher: allows a fixed set of tokens, records what it consumed."""

    def __init__(self, allowed):
        self.allowed, self.consumed = allowed, []

    def is_error(self):
        return False

    def consume_token(self, t):
        self.consumed.append(t)
        return True


def test_grammar_rows_sample_only_allowed_tokens(monkeypatch):
    sampler = make_sampler({0: SamplingParams(temperature=1.0, seed=1), 1: SamplingParams(temperature=0.0)})
    matcher = _Matcher([3, 40])
    sampler.requests[0].matcher = matcher

    def masks(matchers):
        out = torch.zeros((len(matchers), (V + 31) // 32), dtype=torch.int32)
        for i, m in enumerate(matchers):
            for t in m.allowed:
                out[i, t // 32] |= 1 << (t % 32)
        return out

    monkeypatch.setattr(sampler.grammars, "masks", masks)
    logits = random_logits(2)
    for _ in range(20):
        tokens, _ = sampler.sample([0, 1], logits)
        assert tokens[0] in (3, 40) and tokens[1] == int(logits[1].argmax())
    assert len(matcher.consumed) == 20


def test_grammar_with_llguidance_and_the_tiny_tokenizer(tiny_tokenizer_dir):
    import json

    import llguidance

    from ferry.services.worker.grammar import tokenizer_factory

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    vocab = len(tok) + 5  # a model's embedding may be wider than the tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(vocab, "cpu", seed=0, grammar_tokenizer=tokenizer_factory(tiny_tokenizer_dir, vocab, [eos]))
    sampler.add_request(
        NewRequest(
            req_id=1,
            prompt_token_ids=np.array([1], np.int32),
            sampling=SamplingParams(temperature=1.0, seed=3, grammar=grammar),
        )
    )
    out = []
    for _ in range(40):
        token = int(sampler.sample([1], torch.randn(1, vocab))[0][0])
        if token == eos:
            break
        out.append(token)
    assert json.loads(tok.decode(out)) in ({"ok": True}, {"ok": False})


def test_requests_with_one_grammar_compile_it_once_and_keep_their_own_state(tiny_tokenizer_dir, monkeypatch):
    """n choices arrive as n requests with one grammar: the worker compiles it once (compiling runs on the
    step thread) and gives each a copy, whose state is its own: each still samples valid JSON."""
    import json

    import llguidance

    from ferry.services.worker import grammar as G

    compiled = []
    real = llguidance.LLMatcher

    def counting(*args, **kwargs):
        compiled.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    grammar = real.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(vocab, "cpu", seed=0, grammar_tokenizer=G.tokenizer_factory(tiny_tokenizer_dir, vocab, [eos]))
    ids = [1, 2, 3, 4]
    for r in ids:
        sampler.add_request(
            NewRequest(
                req_id=r,
                prompt_token_ids=np.array([1], np.int32),
                sampling=SamplingParams(temperature=1.0, seed=r, grammar=grammar),
            )
        )
    assert len(compiled) == 1
    outs = {r: [] for r in ids}
    done = set()
    for _ in range(40):
        live = [r for r in ids if r not in done]
        if not live:
            break
        tokens = sampler.sample(live, torch.randn(len(live), vocab))[0]
        for r, t in zip(live, tokens.tolist()):
            if t == eos:
                done.add(r)
            else:
                outs[r].append(t)
    assert all(json.loads(tok.decode(o)) in ({"ok": True}, {"ok": False}) for o in outs.values())


def test_a_grammar_whose_matcher_dies_reports_its_request_and_a_healthy_one_never_does(tiny_tokenizer_dir):
    """A schema llguidance compiles but cannot go on with (every value nests another without end: the api
    refuses the plain forms; this one it cannot tell) leaves the matcher dead after "{": its row then only
    draws the end of sequence, and `grammar_failures` names the request, so that it fails instead of ending
    as if its output were complete. A grammar that completes (end of sequence included) is never reported."""
    import json

    import llguidance
    from transformers import AutoTokenizer

    from ferry.services.worker.grammar import tokenizer_factory

    style = {"whitespace_flexible": False}
    endless = {
        "type": "object",
        "required": ["a"],
        "patternProperties": {"^a$": {"$ref": "#"}},
        "additionalProperties": False,
    }
    healthy = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    vocab, eos = len(tok), tok.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(vocab, "cpu", seed=0, grammar_tokenizer=tokenizer_factory(tiny_tokenizer_dir, vocab, [eos]))
    for rid, schema in ((1, endless), (2, healthy)):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=style)
        sampler.add_request(
            NewRequest(
                req_id=rid,
                prompt_token_ids=np.array([1], np.int32),
                sampling=SamplingParams(temperature=1.0, seed=rid, grammar=grammar),
            )
        )
    out: dict[int, list[int]] = {1: [], 2: []}
    failures = []
    for _ in range(40):
        live = [r for r in (1, 2) if eos not in out[r] and r not in dict(failures)]
        if not live:
            break
        tokens = sampler.sample(live, torch.randn(len(live), vocab))[0].tolist()
        for r, t in zip(live, tokens):
            out[r].append(t)
        failures += sampler.grammar_failures(live)
    assert [r for r, _ in failures] == [1] and "Too many items" in failures[0][1], failures
    assert tok.decode(out[1]) == "{"  # it died on the token after the only one it could write
    assert out[2][-1] == eos and json.loads(tok.decode(out[2][:-1])) in ({"ok": True}, {"ok": False})
    assert sampler.grammar_failures([1, 2]) == ((1, failures[0][1]),)


def test_a_grammar_no_token_can_continue_fails_its_request_instead_of_stopping():
    """Not accepting, and no token of the vocabulary continues the grammar ("b" has none): llguidance puts the
    matcher in its error state, the mask falls back to the end of sequence, and the request is reported."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    class Vocabulary:  # tokens a, c and the end of sequence: no "b"
        eos_token_id, bos_token_id, special_token_ids = 2, None, [2]
        tokens = [b"a", b"c", b"</s>"]

        def __call__(self, text):
            text = text.decode() if isinstance(text, bytes) else text
            return [{"a": 0, "c": 1}[ch] for ch in text if ch in "ac"]

    sampler = Sampler(3, "cpu", seed=0, grammar_tokenizer=lambda: LLTokenizer(TokenizerWrapper(Vocabulary())))
    grammar = LLMatcher.grammar_from_lark('start: "a" "b"\n')
    sampler.add_request(
        NewRequest(
            req_id=1,
            prompt_token_ids=np.array([1], np.int32),
            sampling=SamplingParams(temperature=1.0, grammar=grammar),
        )
    )
    assert sampler.sample([1], torch.zeros(1, 3))[0].tolist() == [0] and sampler.grammar_failures([1]) == ()
    assert sampler.sample([1], torch.zeros(1, 3))[0].tolist() == [2]  # only the end of sequence is left
    ((rid, why),) = sampler.grammar_failures([1])
    assert rid == 1 and why
