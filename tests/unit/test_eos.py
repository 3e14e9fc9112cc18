import json

from ferry.services.api.tokenizer import PromptTokenizer
from ferry.shared.eos import eos_token_ids


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert eos_token_ids(tmp_path) == (3, 7, 9)


def test_the_api_stops_on_the_generation_config_eos_too(tiny_models):
    model = tiny_models["qwen3_moe"]
    tok = PromptTokenizer(str(model))
    gen = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    assert set(gen if isinstance(gen, list) else [gen]) <= set(tok.eos_token_ids)
    assert tok.hf.eos_token_id in tok.eos_token_ids
