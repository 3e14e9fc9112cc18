"""The tests' gpt-oss tokenizer: o200k_harmony (services/tiny_model/harmony_tokenizer.py), saved once a session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferry.services.tiny_model.harmony_tokenizer import harmony_tokenizer


def build_harmony_tokenizer(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    harmony_tokenizer().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def harmony_tokenizer_dir(tmp_path_factory) -> Path:
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tokenizer"))
