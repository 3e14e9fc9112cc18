"""The model's Hugging Face tokenizer, from its directory's tokenizer files (AutoTokenizer) or, for a GGUF
file, rebuilt from the file's metadata: its vocabulary, merges, token types, special ids and chat template,
by transformers' own GGUF conversion (`transformers.integrations.gguf.convert_gguf_tokenizer`). The file is
read with the gguf package (plan/gguf_checkpoint.py), not transformers' reader, which imports torch: the api
process never does (shared/torch_free.py). The api, `ferry generate` and the worker's grammars ask here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.plan.gguf_checkpoint import find_gguf, open_gguf

# special tokens by the metadata key of their id (transformers' get_gguf_tokenizer names them so)
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_tokenizer(model: str | Path) -> Any:
    """The tokenizer of `model`: a GGUF file (or a directory holding one), else a directory or hub id
    for AutoTokenizer."""
    gguf = find_gguf(model) if Path(model).expanduser().exists() else None
    if gguf is not None:
        return gguf_tokenizer(gguf)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def gguf_tokenizer(path: Path) -> Any:
    """A transformers fast tokenizer rebuilt from a GGUF file's `tokenizer.*` metadata (transformers'
    GGUF_TOKENIZER_MAPPING says which key is which), with the file's chat template."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    try:  # before 5.18 the tables sat in a package whose __init__ imports torch, and converted fewer vocabularies
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:
        raise ValueError(
            f"{path}: rebuilding a GGUF file's tokenizer needs transformers >= 5.18 (its torch-free GGUF tokenizer "
            f"tables), this is {transformers.__version__}: pip install 'transformers>=5.18'"
        ) from e

    ckpt = open_gguf(path)
    groups = {
        group: {name: value for key, name in renames.items() if (value := ckpt.value(f"tokenizer.{key}")) is not None}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokens, config = groups["tokenizer"], groups["tokenizer_config"]
    if not tokens.get("tokens"):
        raise ValueError(f"{path}: the GGUF metadata holds no tokenizer (tokenizer.ggml.tokens)")
    if tokens.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say
    for name, key in _SPECIAL_IDS.items():
        token_id = ckpt.value(f"tokenizer.ggml.{key}")
        config[name] = tokens["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(ckpt.architecture, tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
