"""A byte-level BPE tokenizer trained on the built-in corpus, wrapped as a transformers fast tokenizer.

Byte-level means every string round-trips (any byte is a token), so the demo model can take
any prompt. The special tokens and the ChatML template follow Qwen's conventions, so the api's
chat handling is exercised on the tiny model exactly as on a real Qwen checkpoint."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ferry.services.tiny_model.corpus import CORPUS
from ferry.shared.byte_level import bytes_to_unicode

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen3.5's pre-tokenizer split. transformers rebuilds a qwen3_5_moe tokenizer's pipeline with this
# regex (Qwen3_5Tokenizer) while it loads others from tokenizer.json as written: training with the
# same split makes both loaders agree with the tokenizer we save.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as Qwen writes it, tools included (Qwen2.5/Qwen3's convention: the tools' JSON specs in the
# system turn inside <tools>, calls as <tool_call> JSON, results as <tool_response> in a user turn),
# so that tool use runs through the tiny model's template exactly as through a real Qwen's. Without
# tools every message is `<|im_start|>ROLE\nCONTENT<|im_end|>\n`.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Deterministic: the BPE trainer breaks ties by pair order, and the corpus is fixed."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return _chatml_tokenizer(tok)


def printable_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, for real model shapes with random
    weights: a model of Qwen's 151,936-token vocabulary samples any id, and every id must decode.

    The 256 byte tokens, then merges of printable ASCII (pairs, then triples) up to
    `vocab_size - 3`, then the three special tokens. Every merged token is ASCII, so a random
    model's output streams as text instead of being held back as incomplete UTF-8."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    to_char = bytes_to_unicode()
    vocab = {to_char[b]: b for b in range(256)}
    printable = [to_char[b] for b in range(32, 127)]
    merges: list[tuple[str, str]] = []
    wanted = vocab_size - len(SPECIAL_TOKENS)

    def add(a: str, b: str) -> bool:
        if len(vocab) >= wanted:
            return False
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        return True

    pairs = [a + b for a in printable for b in printable]
    done = not all(add(p[0], p[1]) for p in pairs)
    for p in pairs:  # triples: a pair then one more character
        if done:
            break
        for c in printable:
            if not add(p, c):
                done = True
                break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return _chatml_tokenizer(tok)


def _chatml_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` as transformers' fast tokenizer with ChatML's special tokens and template."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
