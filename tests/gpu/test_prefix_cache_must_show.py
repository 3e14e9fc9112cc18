"""Issue 23's measurements on a real hybrid model (Qwen3.6-35B-A3B on an H200), through `ferry serve` and the
official clients. Skipped unless FERRY_MUST_SHOW_MODEL names the model directory (it needs the GPU and the
model); FERRY_MUST_SHOW_FLAGS adds serve flags, FERRY_MUST_SHOW_OUT names the JSON file the figures go to,
FERRY_MUST_SHOW_TOKENS="32000,4000" the first turn's and the system prompt's lengths, FERRY_STEP_TRACE a folder
for each server's step timeline (a smoke run on CPU with
the tiny model: FERRY_MUST_SHOW_TOKENS=300,200 FERRY_MUST_SHOW_FLAGS="--device cpu --max-model-len 1024").

* A three-turn conversation through the openai client and another through the anthropic client, each with
  a first turn of 32k prompt tokens: turns 2 and 3 start from the snapshots of the turn before (at least 95 %
  of the turn before's prompt read from the cache), and their time to first token is at most 0.5 s.
* 8 concurrent streams sharing a 4k-token system prompt (each with its own question): their first tokens
  come at least 5x sooner than with `--no-prefix-cache`. Two rounds each: the first sees the system prompt
  cold (one stream computes it, keeping its state where the prompts part, while the others wait for that
  snapshot), the second warm (as a deployment's steady state); the 5x is asserted on the warm round, and
  both are recorded.

    FERRY_MUST_SHOW_MODEL=/models/qwen3.6-35b-a3b .venv/bin/python -m pytest -q -s \\
        tests/gpu/test_prefix_cache_must_show.py

The JSON (FERRY_MUST_SHOW_OUT, e.g. bench/results/prefix_hybrid.json) has the issue's keys at its top:
turn{1,2,3}_ttft_s (anthropic; openai_turn*_ttft_s beside them), cached_fraction, shared_prompt_speedup,
commit, and every figure under "detail".
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import time
from pathlib import Path

import pytest

from bench.decode_suite import commit
from tests.integration.harness import serve_model

MODEL = os.environ.get("FERRY_MUST_SHOW_MODEL")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not MODEL, reason="FERRY_MUST_SHOW_MODEL is not set")]
FLAGS = shlex.split(os.environ.get("FERRY_MUST_SHOW_FLAGS", ""))
OUT = Path(os.environ.get("FERRY_MUST_SHOW_OUT", "prefix_cache_must_show.json"))
FIRST_TURN, SYSTEM_PROMPT = map(int, os.environ.get("FERRY_MUST_SHOW_TOKENS", "32000,4000").split(","))
WORDS = (
    "ferry river harbour cargo timetable crossing dawn captain deck rope tide lantern bridge quay anchor "
    "passenger ticket engine current mooring channel island bell fog signal"
).split()
RESULTS: dict = {}


def _text(tokenizer, tokens: int, seed: int) -> str:
    """Words of at least `tokens` tokens by the model's tokenizer (the prompt around them adds the chat
    template and the question): whole words are added until the text reaches that many."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    counted = len(tokenizer.encode(" ".join(words), add_special_tokens=False))
    words = words[: tokens * len(words) // counted]  # a word is one token or a little more
    while (short := tokens - len(tokenizer.encode(" ".join(words), add_special_tokens=False))) > 0:
        words += [rng.choice(WORDS) for _ in range(short)]
    return " ".join(words)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module", autouse=True)
def write_results():
    """Writes the figures to OUT, keeping those of the test not run this time when OUT holds them: the two
    tests may run on different models (the issue's three turns on the full-size model, its 8 streams on the
    hybrid cut), one pytest run each. A test that measured nothing (its server did not boot) leaves the
    figures OUT holds for it."""
    yield
    detail = json.loads(OUT.read_text())["detail"] if OUT.exists() else {}
    detail.update({name: got for name, got in RESULTS.items() if _measured(got)})
    OUT.write_text(json.dumps({**issue_keys(detail), "detail": detail}, indent=2) + "\n")


def _measured(figures: dict) -> bool:
    """Whether a test's figures hold a measurement: a turn's TTFT, or the 8 streams' rounds."""
    return "warm_speedup" in figures or any(
        isinstance(v, dict) and v.get("ttft_s") is not None for v in figures.values()
    )


def issue_keys(results: dict) -> dict:
    """The figures under the names bench/results/prefix_hybrid.json keeps: the anthropic client's turns
    (the openai client's beside them), the smallest cached fraction of turns 2 and 3 over both clients,
    the warm shared-prompt speedup, and the commit."""
    out: dict = {"commit": commit()}
    turns = results.get("three_turns", {})
    turns = {k: v for k, v in turns.items() if isinstance(v, dict) and "ttft_s" in v}
    for api, prefix in (("anthropic", ""), ("openai", "openai_")):
        for turn in (1, 2, 3):
            out[f"{prefix}turn{turn}_ttft_s"] = turns.get(f"{api}_turn_{turn}", {}).get("ttft_s")
    fractions = [
        turns[f"{api}_turn_{t}"]["cached_fraction"]
        for api in ("anthropic", "openai")
        for t in (2, 3)
        if f"{api}_turn_{t}" in turns
    ]
    out["cached_fraction"] = min(fractions) if fractions else None
    out["shared_prompt_speedup"] = results.get("eight_streams", {}).get("warm_speedup")
    return out


def _serve(tmp: Path, *flags: str):
    """`ferry serve MODEL` on the GPU (or as FERRY_MUST_SHOW_FLAGS says) until the block ends; loading the
    model may take minutes."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = None
    if os.environ.get("FERRY_STEP_TRACE"):  # each step's timeline (shared/step_trace.py), a folder a server
        trace = Path(os.environ["FERRY_STEP_TRACE"]) / tmp.name
        trace.mkdir(parents=True, exist_ok=True)
        env = {"FERRY_STEP_TRACE": str(trace)}
    return serve_model(
        Path(MODEL), tmp, env, *FLAGS, *flags, device=None, max_model_len=65536, ready_timeout=1800, stop_timeout=60
    )


def _openai_turn(url, messages, max_tokens=128, client=None):
    import openai

    client = client or openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    t0, first, text, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            delta = c.delta.model_dump()
            if first is None and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                first = time.perf_counter() - t0
            text.append(delta.get("content") or "")
    return first, "".join(text), usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


def _anthropic_turn(url, system, messages, max_tokens=128):
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    t0, first = time.perf_counter(), None
    with client.messages.stream(
        model="tiny", max_tokens=max_tokens, system=system, messages=messages, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            if first is None and event.type == "content_block_delta":
                first = time.perf_counter() - t0
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    return (
        first,
        text,
        final.usage.cache_read_input_tokens,
        final.usage.input_tokens + final.usage.cache_read_input_tokens,
    )


def test_three_turns_with_a_32k_first_turn_answer_turns_2_and_3_within_half_a_second(tokenizer, tmp_path):
    questions = ["Summarise the log above in one sentence.", "Which word comes up most?", "And the least?"]
    ttft: dict = {"model": MODEL, "flags": FLAGS, "commit": commit()}
    RESULTS["three_turns"] = ttft  # filled turn by turn: a client that fails keeps the other's figures
    with _serve(tmp_path) as served:
        messages = [{"role": "user", "content": _text(tokenizer, FIRST_TURN, 1) + "\n\n" + questions[0]}]
        for turn, question in enumerate(questions, start=1):
            if turn > 1:
                messages.append({"role": "user", "content": question})
            first, text, cached, prompt = _openai_turn(served.url, messages)
            ttft[f"openai_turn_{turn}"] = _turn(first, cached, prompt, ttft.get(f"openai_turn_{turn - 1}"))
            messages.append({"role": "assistant", "content": text})
        system, messages = (
            "You read logs.",
            [{"role": "user", "content": _text(tokenizer, FIRST_TURN, 2) + "\n\n" + questions[0]}],
        )
        for turn, question in enumerate(questions, start=1):
            if turn > 1:
                messages.append({"role": "user", "content": question})
            first, text, cached, prompt = _anthropic_turn(served.url, system, messages)
            ttft[f"anthropic_turn_{turn}"] = _turn(first, cached, prompt, ttft.get(f"anthropic_turn_{turn - 1}"))
            messages.append({"role": "assistant", "content": text or "."})
    print(json.dumps(ttft, indent=2))
    for api in ("openai", "anthropic"):
        assert ttft[f"{api}_turn_1"]["prompt_tokens"] >= FIRST_TURN
        for turn in (2, 3):
            got = ttft[f"{api}_turn_{turn}"]
            assert got["cached_fraction"] >= 0.95 and got["ttft_s"] <= 0.5, (api, turn, got)


def _turn(ttft_s, cached: int, prompt: int, before: dict | None) -> dict:
    """One turn's figures. The prefix it shares with the turn before is at least that turn's whole prompt
    (the conversation only grows), so `cached_fraction` is the cached tokens over that prompt's."""
    shared = before["prompt_tokens"] if before else None
    return {
        "ttft_s": ttft_s,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "cached_fraction": cached / shared if shared else None,
    }


def _compiled_in_service(log: Path) -> list[str]:
    """The kernels the worker logged compiling after it was ready (services/worker/compile_watch.py)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [json.loads(x)["kernel"] for x in lines if '"kernel_compiled_in_service"' in x and x.startswith("{")]


STREAMS = 8


def _one_of_the_streams(url: str, system: str, seed: int, i: int, start) -> tuple[float, int, int]:
    """One of the 8 streams, in a process of its own: its client made and its request's body built, it waits
    for the others at `start`, then sends; its TTFT counts from there."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"Question {seed}-{i}: " + " ".join(random.Random(seed * 100 + i).choices(WORDS, k=40)),
        },
    ]
    start.wait(timeout=300)
    first, _text, cached, prompt = _openai_turn(url, messages, max_tokens=16, client=client)
    return first, cached, prompt


def _eight_streams(url, system: str, seed: int, clients) -> list[tuple[float, int, int]]:
    """The 8 streams sent together from 8 processes (`clients`: a process pool and a manager). Eight agents are
    eight processes: sent from 8 threads of this one, the clients built their requests one at a time under
    the GIL and reached the server over ~50 ms, which every stream then waited
    for in its TTFT, the first the longest."""
    pool, manager = clients
    start = manager.Barrier(STREAMS)
    return list(pool.map(_one_of_the_streams, *zip(*[(url, system, seed, i, start) for i in range(STREAMS)])))


@pytest.fixture(scope="module")
def clients():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")  # not a fork of this process, its threads and sockets
    with spawn.Manager() as manager, ProcessPoolExecutor(STREAMS, mp_context=spawn) as pool:
        yield pool, manager


def test_eight_streams_sharing_a_4k_system_prompt_start_5x_sooner_than_without_the_prefix_cache(
    tokenizer, tmp_path, clients
):
    system = "You answer questions about this harbour log.\n" + _text(tokenizer, SYSTEM_PROMPT, 3)
    figures = {}
    for name, flags in (("prefix_cache", ()), ("no_prefix_cache", ("--no-prefix-cache",))):
        with _serve(tmp_path / name, *flags) as served:
            # first-time costs (kernel compiles, autotuning, the expert cache) paid on an unrelated prompt
            _eight_streams(served.url, "Unrelated.\n" + _text(tokenizer, SYSTEM_PROMPT, 4), 0, clients)
            primed = _compiled_in_service(tmp_path / name / "serve.log")
            rounds = {
                "cold": _eight_streams(served.url, system, 1, clients),
                "warm": _eight_streams(served.url, system, 2, clients),
            }
        # a kernel compiled during the rounds would time the compile, not the cache (one of fla's autotunes
        # once made the baseline's warm round 10 s, and the speedup 23x)
        figures[name] = {
            "kernels_compiled_in_rounds": _compiled_in_service(tmp_path / name / "serve.log")[len(primed) :]
        }
        for rnd, streams in rounds.items():
            figures[name] |= {
                f"{rnd}_ttft_s": [t for t, _, _ in streams],
                f"{rnd}_mean_s": statistics.mean(t for t, _, _ in streams),
                f"{rnd}_cached_tokens": [c for _, c, _ in streams],
                f"{rnd}_prompt_tokens": [p for _, _, p in streams],
            }
    for rnd in ("cold", "warm"):
        figures[f"{rnd}_speedup"] = (
            figures["no_prefix_cache"][f"{rnd}_mean_s"] / figures["prefix_cache"][f"{rnd}_mean_s"]
        )
    RESULTS["eight_streams"] = figures | {"model": MODEL, "flags": FLAGS, "commit": commit()}
    print(json.dumps(figures, indent=2))
    assert not any(figures[name]["kernels_compiled_in_rounds"] for name in ("prefix_cache", "no_prefix_cache")), figures
    assert figures["warm_speedup"] >= 5, figures
