"""Issue 22's reproduced problems at the HTTP edge, in process (numbered as in the issue): the depth check
counts right on bodies of any shape (its linear time: bench/json_depth.py), chat_template_kwargs cannot collide with the
template call, errors name their field in `param`, any case of the Bearer scheme is accepted, client-facing messages
name no socket path, a 503 is logged as a warning, logged values are capped, and grammars are built
once per request, on a lane of their own. The same problems against the real processes:
tests/integration/test_http_edge.py."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import threading
from types import SimpleNamespace

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from ferry.services.api import json_limits, schema, structured
from ferry.services.api.http_errors import bearer_token, error_responses
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.routes import LONG_BODY_BYTES, OpenAIRoutes, TokenizerBusy
from ferry.shared.errors import InvalidRequest
from ferry.shared.logging import MAX_LOGGED_CHARS, configure_logging

MIB4 = 4 * 2**20
MSG = [{"role": "user", "content": "hi"}]


# ---- 1. the depth check is linear ---------------------------------------------------------------------


def adversarial_bodies(size: int = MIB4) -> dict[str, bytes]:
    """Bodies of about `size` bytes of the shapes that cost a scanner most."""
    head = b'{"x":' + b"[" * 65
    return {
        "unterminated escaped quotes": head + b'"' + b'\\"' * (size // 2 - 40),  # the regex of old: quadratic
        "escaped backslashes then quotes": head + b'"' + b'\\\\"' * (size // 3 - 40),
        "a run of backslashes": head + b'"' + b"\\" * (size - 80),
        "bare quotes": b"[" * 70 + b'"' * (size - 100),
        "deep nesting": b"[" * (size // 2) + b"]" * (size // 2),
        "brackets in a string": b'{"x": "' + b"[{" * (size // 2 - 10) + b'"}',
        "a long number": head + b"1" * (size - 200) + b"]" * 65 + b"}",
        "many escapes": b'{"messages": [{"role": "user", "content": "' + b"\\u00e9" * (size // 6 - 20) + b'"}]}',
    }


def _reference_depth(text: str) -> int:
    depth = best = i = 0
    inside = False
    while i < len(text):
        c = text[i]
        if inside and c == "\\":
            i += 2
            continue
        if c == '"':
            inside = not inside
        elif not inside and c in "[{":
            depth += 1
            best = max(best, depth)
        elif not inside and c in "]}":
            depth -= 1
        i += 1
    return best


def test_1_the_issues_body_is_counted():
    body = b'{"x":' + b"[" * 65 + b'"' + b'\\"' * 48000  # 17.8 s with the regex of old; timed in bench/json_depth.py
    assert json_limits.json_depth(body) == 66


@pytest.mark.parametrize("shape", list(adversarial_bodies(1024)))
def test_1_a_4mib_body_of_any_shape_is_checked_and_decoded(shape):
    """Refused or decoded, never a RecursionError; the time it takes: bench/json_depth.py."""
    body = adversarial_bodies()[shape]
    assert len(body) <= MIB4
    try:
        schema.decode_body(body, schema.ChatCompletionRequest)
    except InvalidRequest:
        pass


def test_1_the_depth_matches_a_reference_scanner_on_random_json():
    rng = random.Random(0)
    atoms = ['a"b', "\\", "[{", '}]"\\"', "x\\\\", 5, None, '\\\\"[', '"' * 3, "\\u005b"]

    def value(depth: int):
        r = rng.random()
        if depth > 9 or r < 0.3:
            return rng.choice(atoms)
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "[", '"\\', '{"']): value(depth + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(2000):
        text = json.dumps(value(0))
        want = _reference_depth(text)
        if want > json_limits.MAX_JSON_DEPTH or text.count("[") + text.count("{") > json_limits.MAX_JSON_DEPTH:
            assert json_limits.json_depth(text.encode()) == want, text
    deep = "[" * 40 + json.dumps('"[[[[' * 30) + "]" * 40  # under the limit once strings are skipped
    assert json_limits.json_depth(deep.encode()) == 40


def test_1_json_inside_a_tool_calls_arguments_string_is_depth_checked_too():
    args = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError, a 500 of old
    body = {
        "messages": [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": args}}]},
            {"role": "user", "content": "x"},
        ]
    }
    req = schema.decode_body(json.dumps(body).encode(), schema.ChatCompletionRequest)
    with pytest.raises(InvalidRequest, match="nests") as err:
        schema.chat_messages(req)
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"


# ---- 4. chat_template_kwargs -----------------------------------------------------------------------


def test_4_the_reserved_template_keywords_are_every_parameter_of_the_template_call():
    from transformers import PreTrainedTokenizerBase

    from ferry.services.api.tokenizer import PromptTokenizer

    named = {
        p.name
        for f in (PromptTokenizer.chat_prompt, PromptTokenizer.render_chat, PreTrainedTokenizerBase.apply_chat_template)
        for p in inspect.signature(f).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    }
    assert named <= schema.RESERVED_TEMPLATE_KWARGS, named - schema.RESERVED_TEMPLATE_KWARGS


@pytest.mark.parametrize("key", ["tools", "messages", "tokenize", "chat_template", "add_generation_prompt", "self"])
def test_4_a_reserved_template_keyword_is_a_400_naming_it(key):
    req = schema.decode_body(
        json.dumps({"messages": MSG, "chat_template_kwargs": {key: 5}}).encode(), schema.ChatCompletionRequest
    )
    with pytest.raises(InvalidRequest, match=f"chat_template_kwargs.{key}") as err:
        schema.validate_generation(req, None)
    assert err.value.param == f"chat_template_kwargs.{key}"
    fine = schema.decode_body(
        json.dumps({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}).encode(),
        schema.ChatCompletionRequest,
    )
    schema.validate_generation(fine, None)


def test_4_chat_template_kwargs_must_be_an_object():
    with pytest.raises(InvalidRequest) as err:
        schema.decode_body(
            json.dumps({"messages": MSG, "chat_template_kwargs": 5}).encode(), schema.ChatCompletionRequest
        )
    assert err.value.param == "chat_template_kwargs"


# ---- 7. param, Bearer, socket paths, log levels, log caps, grammars -----------------------------------


def _chat(**body):
    body.setdefault("messages", MSG)
    return schema.decode_body(json.dumps(body).encode(), schema.ChatCompletionRequest)


def _param(fn, *args) -> str | None:
    with pytest.raises(InvalidRequest) as err:
        fn(*args)
    return err.value.param


def test_7_errors_about_one_field_name_it_in_param():
    assert (
        _param(schema.decode_body, b'{"messages": [{"role": 5}]}', schema.ChatCompletionRequest) == "messages[0].role"
    )
    assert (
        _param(schema.decode_body, b'{"messages": [], "temperature": "hot"}', schema.ChatCompletionRequest)
        == "temperature"
    )
    assert _param(schema.sampling_params, _chat(temperature=-1), (2,)) == "temperature"
    assert _param(schema.sampling_params, _chat(top_p=0), (2,)) == "top_p"
    assert _param(schema.sampling_params, _chat(logit_bias={"x": 1}), (2,)) == "logit_bias"
    assert _param(schema.validate_generation, _chat(n=17), None) == "n"
    assert _param(schema.validate_generation, _chat(store=True), None) == "store"
    assert (
        _param(schema.chat_messages, _chat(messages=[*MSG, *MSG, {"role": "user", "content": ""}]))
        == "messages[2].content"
    )
    assert _param(schema.chat_messages, _chat(messages=[{"role": "wizard", "content": "x"}])) == "messages[0].role"
    assert _param(schema.chat_logprobs, _chat(top_logprobs=21, logprobs=True)) == "top_logprobs"
    assert _param(schema.template_tools, _chat(tools=[{"type": "web"}])) == "tools[0].type"
    assert _param(structured.response_format_grammar, SimpleNamespace(type="xml")) == "response_format.type"
    completion = schema.decode_body(b'{"prompt": ""}', schema.CompletionRequest)
    assert _param(schema.completion_prompts, completion) == "prompt"
    assert _param(schema.decode_body, b"[1]", schema.ChatCompletionRequest) is None  # the whole body: no one field
    assert _param(schema.sampling_params, _chat(temperature=-1, top_p=0), (2,)) is None  # two fields


@pytest.mark.parametrize(
    "header,ok",
    [
        ("Bearer KEY", True),
        ("bearer KEY", True),
        ("BEARER  KEY ", True),
        ("Basic KEY", False),
        ("BearerKEY", False),
        ("Bearer", False),
        ("", False),
    ],
)
def test_7_the_bearer_scheme_is_case_insensitive(header, ok):
    assert (bearer_token(header) == "KEY") is ok


async def _app_client(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
def api_app(tiny_tokenizer_dir, tmp_path):
    """The api's real app (no scheduler behind its socket: it never becomes ready)."""
    from ferry.services.api.app import build_app
    from ferry.services.api.config import ApiConfig
    from ferry.services.api.tokenizer import PromptTokenizer

    addr = f"ipc://{tmp_path}/private-run-dir/api.sock"
    cfg = ApiConfig(
        host="127.0.0.1",
        port=0,
        scheduler_addr=addr,
        tokenizer=str(tiny_tokenizer_dir),
        served_model_name="tiny",
        api_key="KEY",
        max_body_bytes=MIB4,
        identity="api-test",
    )
    return build_app(cfg, PromptTokenizer(str(tiny_tokenizer_dir))), addr


def test_7_lowercase_bearer_and_no_socket_path_in_what_clients_read(api_app):
    app, addr = api_app

    async def run():
        client = await _app_client(app)
        try:
            answers = []
            for auth in ("bearer KEY", "Bearer KEY", "bearer nope"):
                r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": auth})
                answers.append((r.status, await r.json()))
            health = await client.get("/health")
            return answers, (health.status, await health.text())
        finally:
            await client.close()

    answers, health = asyncio.run(run())
    assert [status for status, _ in answers] == [503, 503, 401], answers  # the key passes; no scheduler yet
    assert "the scheduler" in answers[0][1]["error"]["message"] and "the scheduler" in health[1]
    for text in [json.dumps(body) for _, body in answers] + [health[1]]:
        assert addr not in text and "ipc://" not in text and "api.sock" not in text, text


def test_7_a_503_is_logged_as_a_warning_and_a_bug_as_an_error():
    async def busy(request):
        raise TokenizerBusy("4 prompts are waiting for the tokenizer; retry shortly")

    async def bug(request):
        raise RuntimeError("a bug")

    app = web.Application(middlewares=[error_responses(ApiMetrics())])
    app.router.add_post("/v1/busy", busy)
    app.router.add_post("/v1/bug", bug)

    async def run():
        client = await _app_client(app)
        try:
            return [(await client.post(path)).status for path in ("/v1/busy", "/v1/bug")]
        finally:
            await client.close()

    with capture_logs() as logs:
        assert asyncio.run(run()) == [503, 500]
    levels = {
        e["event"]: e["log_level"]
        for e in logs
        if e["event"] in ("request_refused", "request_failed", "unhandled_error")
    }
    assert levels == {"request_refused": "warning", "unhandled_error": "error"}, logs


def test_7_a_forged_16mib_grammars_error_is_logged_capped(capsys, tiny_tokenizer_dir):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    forged = "x" * (16 * 2**20)  # what a rogue peer's Submit may carry (up to MAX_GRAMMAR_CHARS)
    error = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf, n_vocab=len(hf)), forged).get_error()
    assert len(error) > 2 * len(forged)  # llguidance quotes the grammar: the 33.5 MB line of the issue
    try:
        for fmt in ("json", "console"):
            configure_logging("worker", fmt=fmt)
            structlog.get_logger(f"cap-{fmt}").warning("grammar_error", error=error, nested={"grammar": [forged]})
            logging.getLogger("stdlib").warning("%s", forged)  # aiohttp's and zmq's records go the same way
            lines = capsys.readouterr().err.splitlines()
            assert len(lines) == 2 and all(len(line) < 3 * MAX_LOGGED_CHARS for line in lines), [len(x) for x in lines]
            assert "more characters]" in lines[0] and "grammar_error" in lines[0]
    finally:
        configure_logging("pytest", fmt="json")


class _Tokenizer:
    hf = None

    def copy(self):
        return _Tokenizer()  # the long lane's own


def test_7_a_slow_grammar_holds_up_no_prompt_on_its_own_lane():
    release = threading.Event()

    def slow_grammar(arg):
        release.wait(5)
        return threading.current_thread().name

    def prompt(tokenizer, arg):
        return threading.current_thread().name

    lanes = OpenAIRoutes(SimpleNamespace(), SimpleNamespace(status=None), _Tokenizer(), ApiMetrics())

    async def run():
        grammar = asyncio.ensure_future(lanes.grammars.build(slow_grammar, None, [], "response_format"))
        await asyncio.sleep(0.05)
        short = await asyncio.wait_for(lanes._tokenize(prompt, None, 100), 2)  # not behind the grammar
        long = await asyncio.wait_for(lanes._tokenize(prompt, None, LONG_BODY_BYTES + 1), 2)
        release.set()
        return short, long, await grammar

    short, long, grammar = asyncio.run(run())
    assert grammar.startswith("grammar") and short.startswith("tokenizer") and long.startswith("tokenizer-long")


def test_7_n_choices_build_their_grammar_once_off_the_event_loop(api_app, monkeypatch):
    app, _ = api_app
    built = []
    real = structured.response_format_grammar

    def counted(fmt):
        built.append(threading.current_thread().name)
        return real(fmt)

    monkeypatch.setattr(structured, "response_format_grammar", counted)
    props = {f"p{i}": {"type": "string"} for i in range(200)}
    body = {
        "messages": MSG,
        "n": 16,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": props, "required": list(props)}},
        },
    }

    async def run():
        client = await _app_client(app)
        try:
            r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer KEY"})
            return r.status
        finally:
            await client.close()

    assert asyncio.run(run()) == 503  # built and checked, then refused: no scheduler behind the socket
    assert len(built) == 1 and built[0].startswith("grammar"), built
