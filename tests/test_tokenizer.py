import pytest

from engines_adapters.tokenizer import ByteTokenizer, ChatTemplateError

tok = ByteTokenizer()


def test_ascii_chars_are_tokens():
    assert tok.encode("abc") == [97, 98, 99]
    assert tok.decode(tok.encode("héllo")) == "héllo"


def test_chat_template_is_documented_shape():
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    content = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    parts = tok.apply_chat_template([{"role": "user", "content": content}])
    assert parts == text


@pytest.mark.parametrize("bad", [[], "x", [{"content": "x"}], [{"role": "user", "content": 3}], [1]])
def test_bad_messages_rejected(bad):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(bad)


def test_token_id_prompt():
    assert tok.encode_prompt([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ChatTemplateError):
        tok.encode_prompt([1, 999])
    with pytest.raises(ChatTemplateError):
        tok.encode_prompt([[1], [2]])
