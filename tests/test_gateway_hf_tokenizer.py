"""The `tokenizer = "hf"` mode against a real (tiny, locally built) Hugging Face tokenizer directory
with a chat template: what a deployment pointing at a model directory gets."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from gateway.errors import RequestError  # noqa: E402
from gateway.requests import ParsedRequest  # noqa: E402
from gateway.tokenizers import HFTokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world user assistant the cat sat < >"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "bos_token": "<s>",
        "eos_token": "</s>", "chat_template": TEMPLATE}))
    return str(d), tok


def ids(tok: HFTokenizer, endpoint: str, **body) -> list[int]:
    return asyncio.run(tok.tokens(ParsedRequest(body, endpoint, "m", False, 8)))


def test_chat_uses_the_directory_chat_template(tokenizer_dir):
    path, raw = tokenizer_dir
    tok = HFTokenizer(path)
    got = ids(tok, "chat", messages=[{"role": "user", "content": "hello world"}])
    assert got == raw.encode("< user > hello world < assistant >").ids
    assert all(isinstance(i, int) for i in got)


def test_completions_text_and_token_ids(tokenizer_dir):
    path, raw = tokenizer_dir
    tok = HFTokenizer(path)
    assert ids(tok, "completions", prompt="the cat sat") == raw.encode("the cat sat").ids
    assert ids(tok, "completions", prompt=[5, 6, 7]) == [5, 6, 7]


def test_a_broken_template_input_is_a_400(tokenizer_dir):
    tok = HFTokenizer(tokenizer_dir[0])
    with pytest.raises(RequestError) as e:
        ids(tok, "chat", messages="not a list")
    assert e.value.status == 400


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load the Hugging Face tokenizer at .*nope"):
        HFTokenizer(str(tmp_path / "nope"))
