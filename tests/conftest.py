from tests.doubles.tiny_tokenizer import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
