"""Tokenizer loading, the chat template, and incremental detokenization (UTF-8, stop strings)."""
import json

import pytest

from fake_worker_client import CHATML, IM_END, IM_START, build_tokenizer
from gateway.api_error import APIError
from gateway.tokenizer import RELEASE_GIL_SIZE, IncrementalDetokenizer, Tokenizer
from worker.ipc.messages import RequestOutput

TOKENIZER = build_tokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def stream(detokenizer, token_ids, chunk=1, finish_reason="length", stop_reason=None):
    """Feed `token_ids` as worker outputs of `chunk` tokens; the deltas, stopping at the first finish."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        last = start + chunk >= len(token_ids)
        output = RequestOutput("r", token_ids[start:start + chunk], finish_reason=finish_reason if last else None,
                               stop_reason=stop_reason if last else None)
        deltas.append(detokenizer.update(output))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


@pytest.mark.parametrize("add_generation_prompt, expected", [
    (True, f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nhello{IM_END}\n{IM_START}assistant\n"),
    (False, f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nhello{IM_END}\n"),
])
def test_chat_template_renders_chatml(add_generation_prompt, expected):
    assert TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt) == expected


@pytest.mark.parametrize("layout", ["config_string", "config_named_list", "jinja_file"])
def test_from_dir_finds_the_chat_template_and_special_tokens(tmp_path, layout):
    TOKENIZER.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": IM_END, "special": True}, "bos_token": None}
    if layout == "config_string":
        config["chat_template"] = CHATML
    elif layout == "config_named_list":
        config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    else:
        (tmp_path / "chat_template.jinja").write_text(CHATML)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.special_tokens == {"eos_token": IM_END}
    assert loaded.apply_chat_template(MESSAGES) == TOKENIZER.apply_chat_template(MESSAGES)
    assert loaded.encode("hello world") == TOKENIZER.encode("hello world")


def test_missing_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("template, message", [
    (None, "default chat template is no longer allowed"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% if %}", "Chat template error"),
])
def test_chat_template_failures_are_400(template, message):
    tokenizer = Tokenizer(TOKENIZER.backend, template)
    with pytest.raises(APIError, match=message) as caught:
        tokenizer.apply_chat_template(MESSAGES)
    assert caught.value.status == 400


@pytest.mark.parametrize("text", ["hello world", "une fenêtre 😀 日本語", "日本語😀😀", "plain ascii"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_join_to_the_full_decode_and_never_break_utf8(text, chunk):
    ids = TOKENIZER.encode(text)
    deltas = stream(IncrementalDetokenizer(TOKENIZER, []), ids, chunk)
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == ids


def test_multibyte_character_is_held_until_its_last_byte():
    emoji = TOKENIZER.encode("😀")
    assert len(emoji) == 4          # one byte per token in this vocabulary
    deltas = stream(IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("hello")), emoji + TOKENIZER.encode("go"))
    assert [d.text for d in deltas] == ["", "", "", "😀", "go"]


def test_incomplete_character_is_flushed_when_the_request_ends():
    cut = TOKENIZER.encode("😀")[:2]
    deltas = stream(IncrementalDetokenizer(TOKENIZER, []), TOKENIZER.encode("go") + cut)
    assert "".join(d.text for d in deltas) == "go" + TOKENIZER.decode(cut)


@pytest.mark.parametrize("text, stops, include, expected, reason", [
    ("go STOP now", ["STOP"], False, "go ", "STOP"),
    ("go STOP now", ["STOP"], True, "go STOP", "STOP"),
    ("go STOP now", ["now", "OP"], False, "go ST", "OP"),          # the earliest match wins
    ("hello world, hello there", ["o w"], False, "hell", "o w"),   # spans two tokens
    ("une fenêtre 😀 日本語", ["😀"], False, "une fenêtre ", "😀"),   # spans four byte tokens
    ("hello world", ["xyz"], False, "hello world", None),
])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_ends_the_text_and_never_leaks(text, stops, include, expected, reason, chunk):
    ids = TOKENIZER.encode(text)
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], stop=stops, include_stop_str_in_output=include)
    deltas = stream(detokenizer, ids, chunk)
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].finish_reason == ("stop" if reason else "length")
    assert deltas[-1].stop_reason == reason
    if not include:
        assert not any(s in d.text for d in deltas for s in stops)


def test_possible_stop_prefix_is_held_then_released():
    ids = TOKENIZER.encode("go STar")
    assert [TOKENIZER.token_text(t) for t in ids] == ["go", " ", "ST", "a", "r"]
    deltas = stream(IncrementalDetokenizer(TOKENIZER, [], stop=["STOP"]), ids)
    assert [d.text for d in deltas] == ["go", " ", "", "STa", "r"]   # "ST" could start "STOP" until "a"


@pytest.mark.parametrize("include, expected", [(False, "hello"), (True, f"hello{IM_END}")])
def test_stop_token_adds_no_text_unless_included(include, expected):
    ids = TOKENIZER.encode("hello") + [TOKENIZER.backend.token_to_id(IM_END)]
    detokenizer = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=False, include_stop_str_in_output=include)
    deltas = stream(detokenizer, ids, finish_reason="stop")
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].token_ids[-1] == ids[-1]


@pytest.mark.parametrize("skip, expected", [(True, "hello world"), (False, f"hello{IM_START} world")])
def test_special_tokens_are_skipped_on_request(skip, expected):
    ids = TOKENIZER.encode("hello") + [TOKENIZER.backend.token_to_id(IM_START)] + TOKENIZER.encode(" world")
    deltas = stream(IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=skip), ids)
    assert "".join(d.text for d in deltas) == expected


def test_first_token_keeps_its_leading_space_after_the_prompt():
    deltas = stream(IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("hello")), TOKENIZER.encode(" world"))
    assert "".join(d.text for d in deltas) == " world"


def test_worker_error_passes_through_with_its_message():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    delta = detokenizer.update(RequestOutput("r", [], finish_reason="error", error="worker died"))
    assert (delta.text, delta.finish_reason, delta.error) == ("", "error", "worker died")


@pytest.mark.parametrize("length", [RELEASE_GIL_SIZE - 1, RELEASE_GIL_SIZE, 3 * RELEASE_GIL_SIZE])
def test_long_inputs_take_the_batch_calls_with_the_same_answer(length):
    tokenizer = build_tokenizer()
    text = ("une fenêtre à Paris, 日本語 text " * length)[:length]
    ids = tokenizer.backend.encode(text).ids
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids[:length]) == tokenizer.backend.decode(ids[:length])
