"""A real (if tiny) tokenizer for tests: byte-level BPE trained on a short text, saved as a
transformers PreTrainedTokenizerFast with the demo model's ChatML chat template, loadable with AutoTokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = (
    "The ferry carries experts across the bus. Mixture of experts models route each token to a few experts. "
    "Hello world! hello there, général Kenobi. Ünïcödé text: 你好世界, emoji 🚢⚓. 1234567890 + - * / = ? \n"
) * 20


def build_tiny_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ferry.services.tiny_model.tokenizer import CHATML_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE  # the demo model's: ChatML, with Qwen's way of writing tools
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def normal_token_range(tokenizer) -> tuple[int, int]:
    """(first id, count) of ordinary (non-special) tokens: special tokens come first in this vocab."""
    first = max(tokenizer.convert_tokens_to_ids(s) for s in SPECIALS) + 1
    return first, len(tokenizer) - first


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
