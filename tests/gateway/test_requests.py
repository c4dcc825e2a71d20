"""Request decoding and validation (request_validation.py, generation_request.py), the request types, and the error
envelope."""
import json

import pytest

from gateway.api_error import APIError
from gateway.request_types import ChatCompletionRequest, CompletionRequest
from gateway.request_validation import check_token_ids, decode_body, resolve_max_tokens
from worker.ipc.messages import SamplingParams


def completion(**fields) -> CompletionRequest:
    return decode_body(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


def test_error_envelope_has_vllm_shape():
    error = APIError("The model `x` does not exist.", 404, param="model")
    assert error.body() == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                      "param": "model", "code": 404}}


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_inputs() == expected


@pytest.mark.parametrize("prompt", [[1, [2]], [True], [["a"]], [1.5]])
def test_mixed_prompt_is_400(prompt):
    with pytest.raises(APIError, match="prompt must be a string") as caught:
        completion(prompt=prompt).prompt_inputs()
    assert caught.value.param == "prompt"


def test_defaults_map_to_vllm_sampling_params():
    params = completion().sampling_params(16, None, None, 0)
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                    repetition_penalty=1.0, seed=None, stop_token_ids=[])


def test_explicit_fields_map_through():
    request = completion(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=5, presence_penalty=0.3,
                         frequency_penalty=-0.2, repetition_penalty=1.1, stop_token_ids=[4, 4, 9],
                         ignore_eos=True, min_tokens=2)
    params = request.sampling_params(8, 3, 1, 2)
    assert params == SamplingParams(max_tokens=8, min_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1,
                                    seed=7, presence_penalty=0.3, frequency_penalty=-0.2, repetition_penalty=1.1,
                                    stop_token_ids=[4, 9], ignore_eos=True, logprobs=3, prompt_logprobs=1)


@pytest.mark.parametrize("fields, param, message", [
    ({"n": 0}, "n", "n must be at least 1, got 0."),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0."),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3.0."),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be greater than zero, got 0.0."),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5."),
    ({"top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5."),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0, got -1."),
    ({"seed": 2 ** 63}, "seed", f"seed must be a 64-bit integer, got {2 ** 63}."),
    ({"prompt_logprobs": 21}, "prompt_logprobs",
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
])
def test_sampling_checks_use_vllm_messages(fields, param, message):
    with pytest.raises(APIError) as caught:
        request = completion(**fields)
        request.validate_sampling(20, request.logprobs)
    assert (caught.value.message, caught.value.param, caught.value.status) == (message, param, 400)


@pytest.mark.parametrize("fields, param, message", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
    ({"stream_options": {}, "stream": False, "n": "x"}, "n", "Expected `int | null`, got `str`"),
])
def test_raw_checks_run_before_field_validation(fields, param, message):
    with pytest.raises(APIError) as caught:
        completion(**fields)
    assert caught.value.message.startswith(message) and caught.value.param == param


def test_chat_output_budget_prefers_max_completion_tokens():
    request = decode_body(b'{"messages": [], "max_tokens": 5, "max_completion_tokens": 7}', ChatCompletionRequest)
    assert request.max_output_tokens == (7, "max_completion_tokens")
    assert decode_body(b'{"messages": [], "max_tokens": 5}', ChatCompletionRequest).max_output_tokens == \
        (5, "max_tokens")


@pytest.mark.parametrize("requested, prompt_len, expected", [(None, 10, 90), (90, 10, 90), (1, 99, 1)])
def test_output_budget_fits_the_context(requested, prompt_len, expected):
    assert resolve_max_tokens(requested, prompt_len, 100) == expected


@pytest.mark.parametrize("requested, prompt_len, message", [
    (None, 100, "This model's maximum context length is 100 tokens. However, your request has 100 input tokens. "
                "Please reduce the length of the input messages."),
    (91, 10, "'max_tokens' or 'max_completion_tokens' is too large: 91. This model's maximum context length is "
             "100 tokens and your request has 10 input tokens (91 > 100 - 10)."),
    (0, 10, "max_tokens must be at least 1, got 0."),
])
def test_output_budget_errors(requested, prompt_len, message):
    with pytest.raises(APIError) as caught:
        resolve_max_tokens(requested, prompt_len, 100)
    assert caught.value.message == message


@pytest.mark.parametrize("ids, message", [([], "The decoder prompt cannot be empty"),
                                          ([0, 50], "Token id 50 is out of vocabulary"),
                                          ([-3], "Token id -3 is out of vocabulary")])
def test_token_ids_are_checked(ids, message):
    with pytest.raises(APIError, match=message):
        check_token_ids(ids, 50)
