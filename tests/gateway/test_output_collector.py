"""OutputCollector: a stream that keeps up gets every output alone; one that falls behind gets what waits
merged (tokens and logprobs joined, the last finish, the first's once-per-request fields), errors apart."""
from __future__ import annotations

import asyncio

import pytest

from gateway.output_collector import OutputCollector, merge_outputs
from worker.ipc.messages import RequestOutput, TokenLogprob


def output(tokens: list[int], **fields) -> RequestOutput:
    return RequestOutput("r", tokens, num_prompt_tokens=3, **fields)


def logprobs(tokens: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 * t, 1, [(t + 1, -9.0)]) for t in tokens]


async def test_a_stream_that_keeps_up_gets_each_output_alone():
    collector = OutputCollector(asyncio.get_running_loop())
    outputs = [output([1], queue_time=0.25), output([2]), output([3], finish_reason="length")]
    taken = []
    for item in outputs:
        waiting = asyncio.ensure_future(collector.take())
        await asyncio.sleep(0)                     # the stream waits before the output arrives
        collector.put(item)
        taken.append(await waiting)
    assert taken == outputs


async def test_outputs_waiting_together_are_taken_as_one():
    collector = OutputCollector(asyncio.get_running_loop())
    collector.put(output([1, 2], new_logprobs=logprobs([1, 2]), prompt_logprobs=[None], queue_time=0.25,
                         num_cached_tokens=16))
    collector.put(output([3], new_logprobs=logprobs([3])))
    collector.put(output([4], new_logprobs=logprobs([4]), finish_reason="stop", stop_reason=4))
    assert await collector.take() == RequestOutput(
        "r", [1, 2, 3, 4], logprobs([1, 2, 3, 4]), [None], finish_reason="stop", stop_reason=4,
        num_prompt_tokens=3, queue_time=0.25, num_cached_tokens=16)


@pytest.mark.parametrize("before", [0, 1, 3])
async def test_an_error_comes_alone_after_the_tokens_before_it(before):
    collector = OutputCollector(asyncio.get_running_loop())
    tokens = [output([t]) for t in range(before)]
    error = output([], finish_reason="error", error="The server is shutting down.", status_code=503)
    for item in [*tokens, error, output([99], finish_reason="abort")]:
        collector.put(item)
    if before:
        assert await collector.take() == merge_outputs(tokens)
    assert await collector.take() == error
    assert await collector.take() == output([99], finish_reason="abort")


def test_merging_one_output_changes_nothing():
    item = output([7], new_logprobs=logprobs([7]), queue_time=0.5)
    assert merge_outputs([item]) == item


async def test_on_arrival_sees_every_output_unmerged():
    seen = []
    collector = OutputCollector(asyncio.get_running_loop(), seen.append)
    outputs = [output([1], queue_time=0.25), output([2]), output([3], finish_reason="length")]
    for item in outputs:
        collector.put(item)
    assert (await collector.take()).new_token_ids == [1, 2, 3]
    assert seen == outputs
