"""Who may load adapters and how their names and series are bounded: runtime loading off unless asked
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), no --lora-dir lookups without the API key, adapter name
rules, /metrics forgetting unloaded adapters, and a request racing the unload of its adapter."""
import json

import pytest

from fake_worker_client import FakeWorkerClient
from gateway.__main__ import build_parser
from gateway.config import GatewayConfig
from gateway_app import ADAPTER, ANSWER_IDS, BASE, error_of, serve
from worker.config import LoRAConfig

KEY = {"Authorization": "Bearer secret"}
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture
def lora_dir(tmp_path):
    (tmp_path / "found").mkdir()
    (tmp_path / "found" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    return str(tmp_path)


async def test_runtime_loading_is_off_by_default(lora_dir):
    async with serve(lora=LoRAConfig(lora_dirs=(lora_dir,))) as (http, client, _):
        load = await http.post(LOAD, json={"lora_name": "x", "lora_path": f"{lora_dir}/found"})
        unload = await http.post(UNLOAD, json={"lora_name": ADAPTER})
        auto = await http.post("/v1/completions", json={"model": "found", "prompt": "hi"})
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    assert (load.status_code, unload.status_code) == (404, 404)
    assert error_of(auto) == (404, "The model `found` does not exist.", "model")
    assert models == [BASE, ADAPTER] and client.adapter_commands == [("load", ADAPTER, "/adapters/sql", False, False)]
    assert client.warm_loads == [ADAPTER]        # the --lora-modules adapter is read into the host cache at start
    assert client.settled_after == [1]           # and its memory made ready before the server serves


@pytest.mark.parametrize("value, expected", [(None, False), ("True", True), ("true", True), ("1", True),
                                             ("False", False), ("0", False), ("yes", False)])
def test_vllm_allow_runtime_lora_updating_turns_runtime_loading_on(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    args = build_parser().parse_args(["serve", "--model", "/m"])
    assert GatewayConfig.from_args(args).allow_runtime_lora_updating is expected
    flagged = build_parser().parse_args(["serve", "--model", "/m", "--no-allow-runtime-lora-updating"])
    assert flagged.allow_runtime_lora_updating is False


@pytest.mark.parametrize("route, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                                         ("/v1/completions/render", {"prompt": "hi"}),
                                         ("/v1/chat/completions/render",
                                          {"messages": [{"role": "user", "content": "hi"}]})])
async def test_tokenize_and_render_without_the_key_neither_load_nor_reveal_adapter_directories(lora_dir, route,
                                                                                               body):
    async with serve(lora=LoRAConfig(lora_dirs=(lora_dir,)), api_key="secret",
                     allow_runtime_lora_updating=True) as (http, client, _):
        found = await http.post(route, json={"model": "found", **body})
        missing = await http.post(route, json={"model": "missing", **body})
        served = await http.post(route, json={"model": ADAPTER, **body})
        models = [m["id"] for m in (await http.get("/v1/models", headers=KEY)).json()["data"]]
        with_key = await http.post(route, json={"model": "found", **body}, headers=KEY)
    assert error_of(found) == (404, "The model `found` does not exist.", "model")
    assert error_of(missing) == (404, "The model `missing` does not exist.", "model")
    assert served.status_code == 200 and "found" not in models
    assert with_key.status_code == 200
    if route.endswith("/render"):       # open like /tokenize; the route it renders for still needs the key
        async with serve(api_key="secret") as (http, _, _):
            assert (await http.post(route.removesuffix("/render"), json={"model": ADAPTER, **body})).status_code == 401


@pytest.mark.parametrize("name, rule", [
    ("a" * 256, "An adapter name must be at most 255 characters long, got 256."),
    ("a,b", "An adapter name must not contain commas, whitespace or control characters."),
    ("a b", "An adapter name must not contain commas, whitespace or control characters."),
    ("a\tb", "An adapter name must not contain commas, whitespace or control characters."),
    ("a\x00b", "An adapter name must not contain commas, whitespace or control characters."),
    ("a\x7fb", "An adapter name must not contain commas, whitespace or control characters."),
])
async def test_adapter_names_follow_the_rules(name, rule):
    async with serve(allow_runtime_lora_updating=True) as (http, client, _):
        response = await http.post(LOAD, json={"lora_name": name, "lora_path": "/adapters/x"})
    assert error_of(response) == (400, rule, "lora_name")
    assert len(client.adapter_commands) == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "/m", "--lora-modules", f"{name}=/adapters/x"])


async def test_the_longest_allowed_name_loads():
    async with serve(allow_runtime_lora_updating=True) as (http, _, _):
        response = await http.post(LOAD, json={"lora_name": "a" * 255, "lora_path": "/adapters/x"})
    assert response.status_code == 200


@pytest.mark.parametrize("model", ["a\x00b", "../found", "a" * 100_000, "found\n"])
async def test_a_model_name_no_adapter_may_have_is_not_found(lora_dir, model):
    async with serve(lora=LoRAConfig(lora_dirs=(lora_dir,)), allow_runtime_lora_updating=True) as (http, _, _):
        response = await http.post("/v1/completions", json={"model": model, "prompt": "hi"})
    assert error_of(response)[0] == 404


async def test_a_nul_byte_in_lora_path_is_a_bad_request():
    async with serve(allow_runtime_lora_updating=True,
                     lora=LoRAConfig(lora_dirs=("/adapters",))) as (http, client, _):
        response = await http.post(LOAD, json={"lora_name": "x", "lora_path": "/adapters/x\x00y"})
    assert error_of(response) == (400, "The lora adapter path must not contain a NUL character.", "lora_path")
    assert len(client.adapter_commands) == 1


async def test_an_unloaded_adapter_leaves_metrics():
    name = "poet-" + "x" * 200
    async with serve(allow_runtime_lora_updating=True) as (http, _, _):
        await http.post(LOAD, json={"lora_name": name, "lora_path": "/adapters/poet"})
        await http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 3})
        await http.post("/v1/completions", json={"model": ADAPTER, "prompt": "hi", "max_tokens": 3})
        during = (await http.get("/metrics")).text
        await http.post(UNLOAD, json={"lora_name": name})
        after = (await http.get("/metrics")).text
    assert during.count(f'lora_name="{name}"') == 3
    assert name not in after
    assert after.count(f'lora_name="{ADAPTER}"') == 3


def gone_client() -> FakeWorkerClient:
    """A worker whose adapter was unloaded after the gateway resolved it: its requests fail as not found."""
    client = FakeWorkerClient(lambda request: list(ANSWER_IDS))
    client.error, client.error_status = f"The model `{ADAPTER}` does not exist.", 404
    return client


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "hi"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
async def test_a_request_racing_the_unload_of_its_adapter_is_not_found(route, body):
    async with serve(gone_client()) as (http, _, _):
        whole = await http.post(route, json={"model": ADAPTER, **body})
        streamed = await http.post(route, json={"model": ADAPTER, "stream": True, **body})
    assert error_of(whole) == (404, f"The model `{ADAPTER}` does not exist.", "model")
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    last = json.loads(streamed.text.split("\n\n")[-3].removeprefix("data: "))
    assert last == {"error": {"message": f"The model `{ADAPTER}` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}
