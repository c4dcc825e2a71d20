"""bench.serve: SSE timing and errors, send schedule and concurrency, presets and flags, and whole runs
against a live demo server on CPU whose JSON must add up and agree with its own records."""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tokenizers

import bench.serve as serve
from bench.presets import PRESETS
from bench.report import PERCENTILES, RequestRecord
from bench.serve import Endpoint, Progress, build_parser, workload_from_args
from bench.workloads import RequestSpec, Workload
from tests.server_process import free_port, wait_until_healthy
from worker.demo import SERVED_MODEL_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_ADAPTERS = ("doctests", "chat")
SUMMARY_KEYS = {"num_requests", "completed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "concurrency"} | {
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "std", "median", *(f"p{p}" for p in PERCENTILES))}


# SSE parsing, against scripted responses

def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text: str) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def send_scripted(body: bytes, status: int = 200, endpoint: Endpoint | None = None,
                        spec: RequestSpec | None = None) -> tuple[RequestRecord, dict]:
    seen = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), auth=request.headers.get("authorization"))
        return httpx.Response(status, content=body)

    endpoint = endpoint or Endpoint("http://server", "base")
    spec = spec or RequestSpec([1, 2, 3], 3, 4, "lora-1")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await serve.send(client, endpoint, spec, time.perf_counter()), seen


async def test_stream_is_timed_per_chunk_and_counted_from_usage():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    record, _ = await send_scripted(sse(chunk("a"), chunk("b"), chunk("cd"), usage, "[DONE]"))
    assert record.ok and record.output_tokens == 4 and record.prompt_tokens == 3
    assert len(record.itls) == 2 and record.ttft is not None
    assert record.ttft + sum(record.itls) <= record.e2el


async def test_stream_without_usage_counts_one_token_per_chunk():
    record, _ = await send_scripted(sse(chunk("a"), chunk("b"), chunk("c"), "[DONE]"))
    assert record.ok and record.output_tokens == 3 and record.prompt_tokens == 3


@pytest.mark.parametrize("body, status, error", [
    (json.dumps({"error": {"message": "The model `x` does not exist.", "code": 404}}).encode(), 404,
     "HTTP 404: The model `x` does not exist."),
    (b"upstream down", 502, "HTTP 502: upstream down"),
    (sse(chunk("a"), {"error": {"message": "worker died"}}, "[DONE]"), 200, "stream error: worker died"),
    (sse("[DONE]"), 200, "the stream ended without a completion chunk"),
    (b"data: {not json\n\n", 200, "JSONDecodeError"),
])
async def test_failures_are_recorded_not_raised(body, status, error):
    record, _ = await send_scripted(body, status)
    assert not record.ok and error in record.error


@pytest.mark.parametrize("field, adapter, expected", [
    ("model", "lora-1", {"model": "lora-1"}),
    ("lora_path", "lora-1", {"model": "base", "lora_path": "lora-1"}),
    ("model", None, {"model": "base"}),
])
async def test_payload_names_the_adapter_in_the_chosen_field(field, adapter, expected):
    endpoint = Endpoint("http://server", "base", api_key="k", adapter_field=field)
    _, seen = await send_scripted(sse(chunk("a")), endpoint=endpoint, spec=RequestSpec([7, 8], 2, 5, adapter))
    assert seen == {**expected, "prompt": [7, 8], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "auth": "Bearer k"}


async def test_payload_carries_the_structured_outputs_given():
    endpoint = Endpoint("http://server", "base", structured={"regex": "[a-z]+"})
    _, seen = await send_scripted(sse(chunk("a")), endpoint=endpoint, spec=RequestSpec([7], 1, 5, None))
    assert seen["structured_outputs"] == {"regex": "[a-z]+"}


def test_structured_outputs_flag_reaches_every_request_against_a_live_server(server, tmp_path):
    """Against the CPU demo server: a valid regex constrains every request, which completes; one the server refuses
    fails every request with its 400."""
    url, _ = server
    common = ["--base-url", url, "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "6",
              "--no-plots", "--no-progress", "--out", str(tmp_path / "run.json")]
    result = serve.main([*common, "--structured-outputs", '{"regex": "(ab)+"}'])
    assert result["summary"]["completed"] == 4 and result["summary"]["errors"] == 0
    result = serve.main([*common, "--structured-outputs", '{"regex": "(ab"}'])
    assert result["summary"]["errors"] == 4
    assert all("400" in r["error"] or "regex" in r["error"].lower() for r in result["records"]), result["records"]


# send schedule, with `send` replaced by a timed stand-in

@pytest.fixture
def fake_send(monkeypatch):
    state = {"in_flight": 0, "peak": 0}

    async def send(client, endpoint, spec, start):
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        sent = time.perf_counter() - start
        await asyncio.sleep(0.05)
        state["in_flight"] -= 1
        return RequestRecord(spec.adapter, spec.output_len, send_time=sent, ttft=0.01, e2el=0.05, output_tokens=1)

    monkeypatch.setattr(serve, "send", send)
    return state


async def test_requests_are_sent_at_their_due_times(fake_send):
    specs = Workload(num_prompts=3, input_len=(2, 2)).requests(seed=0)
    records, duration = await serve.run(Endpoint("http://x", "m"), specs, [0.0, 0.15, 0.3], None,
                                        Progress(3, False), 10.0)
    sent = [r.send_time for r in records]
    assert all(due <= t < due + 0.1 for t, due in zip(sent, [0.0, 0.15, 0.3])), sent
    assert duration >= 0.35 and fake_send["peak"] == 1


async def test_max_concurrency_caps_requests_in_flight(fake_send):
    specs = Workload(num_prompts=6, input_len=(2, 2)).requests(seed=0)
    _, duration = await serve.run(Endpoint("http://x", "m"), specs, [0.0] * 6, 2, Progress(6, False), 10.0)
    assert fake_send["peak"] == 2 and duration >= 0.15


# presets and flags

@pytest.mark.parametrize("name, prompts, rate, adapters, choice, input_len, output_len", [
    ("sglang-single-adapter", 480, 8.0, 1, "identical", (1, 256), (1, 256)),
    ("sglang-multi-adapter", 200, 4.0, 6, "uniform", (1, 512), (1, 512)),
    ("overlap-loading", 256, math.inf, 16, "distinct", (512, 512), (128, 128)),
    ("slora-5", 600, 2.0, 5, "zipf", (8, 512), (8, 512)),
    ("slora-8", 600, 2.0, 8, "zipf", (8, 512), (8, 512)),
    ("slora-100", 600, 2.0, 100, "zipf", (8, 512), (8, 512)),
    ("slora-1000", 600, 2.0, 1000, "zipf", (8, 512), (8, 512)),
])
def test_presets_describe_the_peers_workloads(name, prompts, rate, adapters, choice, input_len, output_len):
    workload = workload_from_args(build_parser().parse_args(["--preset", name]))
    assert (workload.num_prompts, workload.request_rate, len(workload.adapters), workload.adapter_choice,
            workload.input_len, workload.output_len) == (prompts, rate, adapters, choice, input_len, output_len)
    assert workload.adapters[-1] == f"lora-{adapters - 1}" and workload.arrival == "poisson"


def test_preset_server_flags_carry_the_slot_limits():
    assert "--max-loras 3" in PRESETS["sglang-multi-adapter"].server_args
    assert "--max-loras 8" in PRESETS["overlap-loading"].server_args
    assert PRESETS["overlap-loading"].workload.max_concurrency == 16
    assert PRESETS["slora-1000"].workload.zipf_alpha == 1.0
    assert PRESETS["slora-1000"].make_adapters_args() == "--num 1000 --rank 8 --targets q_proj,k_proj,v_proj,o_proj"
    assert PRESETS["sglang-multi-adapter"].make_adapters_args() == "--num 6 --rank 16"


def test_flags_override_the_preset():
    args = build_parser().parse_args(["--preset", "sglang-multi-adapter", "--num-prompts", "10", "--lora-prefix",
                                      "x", "--random-input-len", "100", "--random-range-ratio", "0.5"])
    workload = workload_from_args(args)
    assert workload.num_prompts == 10 and workload.input_len == (50, 150) and workload.output_len == (1, 512)
    assert workload.adapters == tuple(f"x-{i}" for i in range(6)) and workload.request_rate == 4.0


def test_flags_alone_build_a_workload():
    args = build_parser().parse_args(["--lora-names", "a", "b", "--lora-choice", "zipf", "--zipf-alpha", "1.5",
                                      "--output-len-range", "3", "9", "--request-rate", "5", "--arrival", "constant"])
    assert workload_from_args(args) == Workload(output_len=(3, 9), adapters=("a", "b"), adapter_choice="zipf",
                                                zipf_alpha=1.5, request_rate=5.0, arrival="constant")


# whole runs against a live demo server on CPU

@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    command = [sys.executable, "-m", "gateway", "serve", "--model", str(demo.model_dir), "--served-model-name",
               SERVED_MODEL_NAME, "--lora-modules", *(f"{n}={demo.adapters[n]}" for n in SERVED_ADAPTERS),
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--max-loras", "2",
               "--uvicorn-log-level", "warning"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log_path)
        yield url, demo
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def reference_stats(values_s: list[float]) -> dict[str, float]:
    """mean, median and percentiles in ms by the statistics module (linear interpolation)."""
    ms = [v * 1000.0 for v in values_s]
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms),
            **{f"p{p}": cuts[p - 1] for p in PERCENTILES}}


def test_run_against_live_server_adds_up(server, tmp_path):
    url, _ = server
    adapters = [*SERVED_ADAPTERS, "no-such-adapter"]
    out = tmp_path / "run.json"
    result = serve.main(["--base-url", url, "--num-prompts", "12", "--input-len-range", "4", "24",
                         "--output-len-range", "2", "6", "--lora-names", *adapters, "--lora-choice", "distinct",
                         "--request-rate", "40", "--warmup-requests", "2", "--seed", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    summary, records = result["summary"], result["records"]
    assert set(summary) == SUMMARY_KEYS and result["settings"]["model"] == SERVED_MODEL_NAME
    specs = Workload(num_prompts=12, input_len=(4, 24), output_len=(2, 6), adapters=tuple(adapters),
                     adapter_choice="distinct").requests(seed=3)
    assert [r["adapter"] for r in records] == [s.adapter for s in specs]
    failed = [r for r in records if r["error"] is not None]
    done = [r for r in records if r["error"] is None]
    assert summary["num_requests"] == 12 == summary["completed"] + summary["errors"]
    assert summary["errors"] == len(failed) == 4
    assert all(r["adapter"] == "no-such-adapter" and "does not exist" in r["error"] for r in failed)
    for r, spec in zip(records, specs):
        if r["error"] is None:
            expected = (spec.prompt_len, spec.output_len, spec.output_len)
            assert (r["prompt_tokens"], r["max_tokens"], r["output_tokens"]) == expected
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert summary["request_throughput"] == pytest.approx(len(done) / summary["duration_s"])
    metrics = {"ttft": [r["ttft"] for r in done], "e2el": [r["e2el"] for r in done],
               "itl": [gap for r in done for gap in r["itls"]],
               "tpot": [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in done]}
    for metric, values in metrics.items():
        for stat, expected in reference_stats(values).items():
            assert summary[f"{stat}_{metric}_ms"] == pytest.approx(expected, rel=1e-9), (metric, stat)


def test_plots_are_written_when_matplotlib_is_installed(server, tmp_path):
    url, _ = server
    serve.main(["--base-url", url, "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3",
                "--out", str(tmp_path / "run.json"), "--no-progress"])
    try:
        import matplotlib  # noqa: F401
        expected = ["run.json", "run.latency_cdf.png", "run.throughput.png"]
    except ImportError:
        expected = ["run.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected


def test_max_concurrency_bounds_overlap_on_live_server(server, tmp_path):
    url, _ = server
    result = serve.main(["--base-url", url, "--model", SERVED_MODEL_NAME, "--num-prompts", "8",
                         "--random-input-len", "8", "--random-output-len", "4", "--max-concurrency", "2",
                         "--lora-names", *SERVED_ADAPTERS, "--no-plots", "--out", str(tmp_path / "run.json")])
    records = result["records"]
    assert all(r["error"] is None for r in records)
    events = sorted([(r["send_time"], 1) for r in records] + [(r["send_time"] + r["e2el"], -1) for r in records])
    in_flight = [sum(step for _, step in events[:i + 1]) for i in range(len(events))]
    assert max(in_flight) == 2


def test_jsonl_prompts_are_counted_by_the_server(server, tmp_path):
    url, demo = server
    texts = ["The weather this week", "A public library is one of the most generous ideas"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t, "max_tokens": 3}) + "\n" for t in texts))
    result = serve.main(["--base-url", url, "--dataset-path", str(dataset), "--num-prompts", "2", "--no-plots",
                         "--out", str(tmp_path / "run.json")])
    tokenizer = tokenizers.Tokenizer.from_file(str(demo.model_dir / "tokenizer.json"))
    assert [r["prompt_tokens"] for r in result["records"]] == [len(tokenizer.encode(t).ids) for t in texts]
    assert [r["output_tokens"] for r in result["records"]] == [3, 3]


# several client processes

def test_client_processes_default_to_one_per_64_streams_within_the_cores(monkeypatch):
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 8)
    assert [serve.client_processes(0, c) for c in (None, 1, 64, 65, 256, 512, 4096)] == [1, 1, 1, 2, 4, 8, 8]
    assert serve.client_processes(3, 256) == 3 and serve.client_processes(2, None) == 2


@pytest.mark.parametrize("prompts, rate, cap, expected", [(256, math.inf, None, 256), (256, math.inf, 32, 32),
                                                          (256, 8.0, None, None), (256, 8.0, 100, 100)])
def test_streams_in_flight_is_the_cap_or_every_request_sent_at_once(prompts, rate, cap, expected):
    load = Workload(num_prompts=prompts, request_rate=rate, max_concurrency=cap)
    assert serve.streams_in_flight(load) == expected


@pytest.mark.parametrize("num, cap, processes", [(10, 4, 3), (7, None, 2), (5, 2, 4), (3, 8, 4)])
def test_deal_covers_every_request_once_with_caps_summing_to_the_concurrency(num, cap, processes):
    specs = Workload(num_prompts=num, input_len=(2, 2)).requests(seed=0)
    shares = serve.deal(specs, cap, processes)
    assert sorted(i for indices, _ in shares for i in indices) == list(range(num))
    assert all(indices == sorted(indices) and indices for indices, _ in shares)
    assert len(shares) == min(processes, num, cap or processes)
    if cap is None:
        assert all(c is None for _, c in shares)
    else:
        assert all(c >= 1 for _, c in shares) and sum(c for _, c in shares) == cap


def test_a_run_over_two_client_processes_adds_up_against_a_live_server(server):
    """Records come back in request order with their adapters; send times count from the earliest process's
    start (both start together at a barrier), and the duration covers the last response."""
    url, _ = server
    endpoint = Endpoint(url, SERVED_MODEL_NAME)
    specs = Workload(num_prompts=6, input_len=(4, 8), output_len=(3, 3), adapters=tuple(SERVED_ADAPTERS),
                     adapter_choice="distinct").requests(seed=1)
    records, duration = asyncio.run(serve.run_processes(endpoint, specs, [0.0] * 6, 2, 2, 60.0))
    assert [r.adapter for r in records] == [s.adapter for s in specs]
    assert all(r.ok and r.output_tokens == 3 and r.prompt_tokens == s.prompt_len for r, s in zip(records, specs))
    assert 0 <= min(r.send_time for r in records) < duration      # from the shared start, not a clock's origin
    assert max(r.send_time + r.e2el for r in records) <= duration + 1e-6
