"""/metrics on the real server: vLLM's metric names, and counters that move by what a request did."""
from __future__ import annotations

import httpx

from worker.demo import SERVED_MODEL_NAME

VLLM_SAMPLES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total", "vllm:lora_requests_info", "vllm:cache_config_info",
                *(f"{histogram}_{part}" for histogram in ("vllm:time_to_first_token_seconds",
                                                          "vllm:inter_token_latency_seconds",
                                                          "vllm:e2e_request_latency_seconds",
                                                          "vllm:request_time_per_output_token_seconds",
                                                          "vllm:request_queue_time_seconds",
                                                          "vllm:request_prefill_time_seconds",
                                                          "vllm:request_decode_time_seconds",
                                                          "vllm:request_inference_time_seconds",
                                                          "vllm:request_prompt_tokens",
                                                          "vllm:request_generation_tokens",
                                                          "vllm:request_params_max_tokens")
                  for part in ("bucket", "sum", "count"))]
ADAPTER_SAMPLES = ["loraplex:lora_requests_total", "loraplex:lora_prompt_tokens_total",
                   "loraplex:lora_generation_tokens_total"]
ADAPTER = "doctests"
NUM_TOKENS = 8


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_page_has_every_vllm_metric_name(server):
    server.openai.completions.create(model=ADAPTER, prompt="hi", max_tokens=2)
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert set(VLLM_SAMPLES + ADAPTER_SAMPLES) <= sample_names(response.text)
    assert 'max_lora="2"' in response.text
    assert f'model_name="{SERVED_MODEL_NAME}"' in response.text


def test_counters_move_by_what_one_adapter_request_did(server, reference):
    adapter_label = f'lora_name="{ADAPTER}"'
    watched = {
        "prompt": ("vllm:prompt_tokens_total", ""),
        "generated": ("vllm:generation_tokens_total", ""),
        "length": ("vllm:request_success_total", 'finished_reason="length"'),
        "ttft": ("vllm:time_to_first_token_seconds_count", ""),
        "itl": ("vllm:inter_token_latency_seconds_count", ""),
        "e2e": ("vllm:e2e_request_latency_seconds_count", ""),
        "queue": ("vllm:request_queue_time_seconds_count", ""),
        "decode": ("vllm:request_decode_time_seconds_count", ""),
        "adapter_requests": ("loraplex:lora_requests_total", adapter_label),
        "adapter_prompt": ("loraplex:lora_prompt_tokens_total", adapter_label),
        "adapter_generated": ("loraplex:lora_generation_tokens_total", adapter_label),
    }
    before = {key: server.metric(*sample) for key, sample in watched.items()}
    server.openai.completions.create(model=ADAPTER, prompt="Fixing a bicycle", temperature=0.0,
                                     max_tokens=NUM_TOKENS, extra_body={"ignore_eos": True})
    after = {key: server.metric(*sample) for key, sample in watched.items()}
    num_prompt = len(reference.encode("Fixing a bicycle"))
    assert {key: after[key] - before[key] for key in watched} == {
        "prompt": num_prompt, "generated": NUM_TOKENS, "length": 1, "ttft": 1, "itl": NUM_TOKENS - 1, "e2e": 1,
        "queue": 1, "decode": 1,
        "adapter_requests": 1, "adapter_prompt": num_prompt, "adapter_generated": NUM_TOKENS}
    assert server.metric("vllm:num_requests_running") == server.metric("vllm:num_requests_waiting") == 0
