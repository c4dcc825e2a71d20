"""Generation through the official OpenAI SDK against the real server, checked against the offline engine."""
from __future__ import annotations

import math

import pytest

from worker.demo import ADAPTERS, SERVED_MODEL_NAME

BASE = SERVED_MODEL_NAME
ADAPTER_NAMES = [spec.name for spec in ADAPTERS]
PROMPT = "The weather this week"
MESSAGES = [{"role": "user", "content": "How do I fix a bicycle?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


async def streamed_completion(server, **request) -> tuple[str, list]:
    """The text of a streamed completion and its chunks."""
    async with server.async_openai() as client:
        chunks = [chunk async for chunk in await client.completions.create(stream=True, **request)]
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


async def streamed_chat(server, **request) -> tuple[str, list]:
    async with server.async_openai() as client:
        chunks = [chunk async for chunk in await client.chat.completions.create(stream=True, **request)]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


@pytest.mark.parametrize("adapter", ADAPTER_NAMES)
def test_each_adapter_changes_greedy_output_and_matches_offline_engine(server, reference, adapter):
    prompt_ids = reference.encode(PROMPT)
    expected = reference.tokens(prompt_ids, adapter, max_tokens=8)
    assert expected != reference.tokens(prompt_ids, None, max_tokens=8)
    response = server.openai.completions.create(model=adapter, prompt=PROMPT, **GREEDY,
                                                  extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert token_ids(choice) == expected
    assert choice.text == reference.decode(expected)


@pytest.mark.parametrize("model", [BASE, "doctests", "asyncio"])
def test_chat_greedy_answer_matches_offline_engine(server, reference, model):
    prompt_ids = reference.chat_prompt(MESSAGES)
    expected = reference.tokens(prompt_ids, None if model == BASE else model, max_tokens=8)
    response = server.openai.chat.completions.create(model=model, messages=MESSAGES, **GREEDY,
                                                       extra_body={"return_token_ids": True})
    assert response.model_extra["prompt_token_ids"] == prompt_ids
    assert token_ids(response.choices[0]) == expected
    assert response.choices[0].message.content == reference.decode(expected)


@pytest.mark.parametrize("model", [BASE, "chat", "docstrings"])
async def test_streamed_completion_text_equals_whole_text(server, model):
    request = {"model": model, "prompt": PROMPT, **GREEDY, "max_tokens": 12}
    async with server.async_openai() as client:
        whole = await client.completions.create(**request)
    text, chunks = await streamed_completion(server, **request)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")


@pytest.mark.parametrize("model", [BASE, "doctests", "asyncio"])
async def test_streamed_chat_text_equals_whole_text_and_role_comes_first_only(server, model):
    request = {"model": model, "messages": MESSAGES, **GREEDY, "max_tokens": 12}
    async with server.async_openai() as client:
        whole = await client.chat.completions.create(**request)
    text, chunks = await streamed_chat(server, **request)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"] + [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_base_colon_adapter_name_selects_the_adapter_and_is_echoed(server):
    client = server.openai
    plain = client.completions.create(model="doctests", prompt=PROMPT, **GREEDY)
    prefixed = client.completions.create(model=f"{BASE}:doctests", prompt=PROMPT, **GREEDY)
    assert (plain.model, prefixed.model) == ("doctests", f"{BASE}:doctests")
    assert prefixed.choices[0].text == plain.choices[0].text


def test_completion_usage_counts_prompt_and_generated_tokens(server, reference):
    response = server.openai.completions.create(model=BASE, prompt=PROMPT, **GREEDY,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    num_prompt = len(reference.encode(PROMPT))
    assert len(token_ids(response.choices[0])) == 8
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == \
        (num_prompt, 8, num_prompt + 8)


async def test_streamed_chat_usage_chunk_equals_whole_usage(server, reference):
    request = {"model": "chat", "messages": MESSAGES, **GREEDY,
               "extra_body": {"ignore_eos": True}}
    whole = server.openai.chat.completions.create(**request)
    _, chunks = await streamed_chat(server, **request, stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(reference.chat_prompt(MESSAGES)), 8)


def test_completion_logprobs_match_offline_engine(server, reference):
    prompt_ids = reference.encode(PROMPT)
    outputs = reference.generate(prompt_ids, "chat", max_tokens=6, logprobs=3)
    entries = [lp for o in outputs for lp in o.new_logprobs]
    response = server.openai.completions.create(model="chat", prompt=PROMPT, temperature=0.0,
                                                  max_tokens=6, logprobs=3)
    logprobs = response.choices[0].logprobs
    tokens = [reference.tokenizer.decode([e.token_id], skip_special_tokens=False) for e in entries]
    assert logprobs.tokens == tokens
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-4)
    assert logprobs.text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    for top, entry in zip(logprobs.top_logprobs, entries):
        assert len(top) == 3         # the greedy token is the most likely one, so it is among the top 3
        expected = {reference.tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in entry.top}
        assert top == pytest.approx(expected, abs=1e-4)


def test_chat_logprobs_have_top_alternatives_best_first(server, reference):
    response = server.openai.chat.completions.create(model="asyncio", messages=MESSAGES, **GREEDY,
                                                       logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob) and item.logprob <= 0.0
        assert math.exp(item.top_logprobs[0].logprob) + math.exp(item.top_logprobs[1].logprob) <= 1.0 + 1e-6


def test_echo_prepends_the_prompt_and_scores_its_tokens(server, reference):
    prompt_ids = reference.encode(PROMPT)
    scored_prompt = reference.generate(prompt_ids, None, max_tokens=4, prompt_logprobs=1)[0].prompt_logprobs
    client = server.openai
    plain = client.completions.create(model=BASE, prompt=PROMPT, temperature=0.0, max_tokens=4)
    echoed = client.completions.create(model=BASE, prompt=PROMPT, temperature=0.0, max_tokens=4, echo=True,
                                       logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    n = len(prompt_ids)
    assert len(choice.logprobs.tokens) == n + plain.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:n] == pytest.approx([e.logprob for e in scored_prompt[1:]], abs=1e-4)


def test_n_choices_are_distinct_samples_reproducible_with_a_seed(server):
    client = server.openai
    request = {"model": "doctests", "prompt": PROMPT, "n": 3, "temperature": 1.0, "max_tokens": 6, "seed": 7,
               "extra_body": {"ignore_eos": True}}
    first, again = client.completions.create(**request), client.completions.create(**request)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert [c.text for c in again.choices] == texts
    assert (first.usage.completion_tokens, first.usage.prompt_tokens) == (18, again.usage.prompt_tokens)
    other_seed = client.completions.create(**{**request, "seed": 8})
    assert [c.text for c in other_seed.choices] != texts


async def test_seeded_sample_is_the_same_streamed_and_whole(server):
    request = {"model": "docstrings", "messages": MESSAGES, "temperature": 0.8, "max_tokens": 8, "seed": 3}
    whole = server.openai.chat.completions.create(**request)
    text, _ = await streamed_chat(server, **request)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_ends_the_text_before_it(server, stream):
    async with server.async_openai() as client:
        free = (await client.completions.create(model=BASE, prompt=PROMPT, temperature=0.0, max_tokens=16)).choices[0]
    middle = len(free.text) // 2
    stop = free.text[middle:middle + 2]
    assert len(stop) == 2 and "\ufffd" not in stop, free.text
    expected = free.text[:free.text.find(stop)]
    request = {"model": BASE, "prompt": PROMPT, "temperature": 0.0, "max_tokens": 16, "stop": [stop, "never seen"]}
    if stream:
        text, chunks = await streamed_completion(server, **request)
        last = chunks[-1].choices[0]
    else:
        async with server.async_openai() as client:
            last = (await client.completions.create(**request)).choices[0]
            text = last.text
    assert text == expected
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop)
