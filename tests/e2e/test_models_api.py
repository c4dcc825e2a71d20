"""/v1/models cards and the runtime adapter load/unload round trip on the real server."""
from __future__ import annotations

import openai
import pytest

from worker.demo import ADAPTERS, SERVED_MODEL_NAME

BASE = SERVED_MODEL_NAME
RUNTIME = "runtime-rslora"           # a second name for the docstrings adapter's directory, loaded at run time
GREEDY = {"prompt": "In the garden", "temperature": 0.0, "max_tokens": 8}


def test_model_list_has_the_base_then_the_adapters_with_their_lineage(server):
    cards = {card.id: card for card in server.openai.models.list().data}
    assert list(cards) == [BASE, *(spec.name for spec in ADAPTERS)]
    base = cards[BASE]
    assert (base.object, base.owned_by, base.model_extra["root"], base.model_extra["parent"],
            base.model_extra["max_model_len"]) == ("model", "vllm", str(server.demo.model_dir), None, 2048)
    for spec in ADAPTERS:
        card = cards[spec.name]
        assert (card.owned_by, card.model_extra["root"], card.model_extra["parent"]) == \
            ("vllm", str(server.demo.adapters[spec.name]), BASE)


@pytest.mark.parametrize("model", [BASE, "asyncio"])
def test_model_card_is_retrievable_by_id(server, model):
    listed = {card.id: card.model_dump() for card in server.openai.models.list().data}[model]
    card = server.openai.models.retrieve(model).model_dump()
    assert card.pop("permission")[0]["object"] == listed.pop("permission")[0]["object"] == "model_permission"
    assert card == listed


def test_unknown_model_card_is_not_found(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.openai.models.retrieve("nope")
    assert raised.value.body == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}


async def test_runtime_adapter_load_serves_it_and_unload_forgets_it(server):
    path = str(server.demo.adapters["docstrings"])
    async with server.http() as http:
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": RUNTIME, "lora_path": path})
        assert (loaded.status_code, loaded.text) == (200, f"Success: LoRA adapter '{RUNTIME}' added successfully.")
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": RUNTIME, "lora_path": path})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

        card = (await http.get(f"/v1/models/{RUNTIME}")).json()
        assert (card["root"], card["parent"]) == (path, BASE)
        runtime = server.openai.completions.create(model=RUNTIME, **GREEDY)
        static = server.openai.completions.create(model="docstrings", **GREEDY)
        base = server.openai.completions.create(model=BASE, **GREEDY)
        assert runtime.choices[0].text == static.choices[0].text != base.choices[0].text
        assert runtime.model == RUNTIME

        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": RUNTIME})
        assert (unloaded.status_code, unloaded.text) == \
            (200, f"Success: LoRA adapter '{RUNTIME}' removed successfully.")
        gone = await http.post("/v1/completions", json={"model": RUNTIME, **GREEDY})
        assert (gone.status_code, gone.json()["error"]["message"]) == (404, f"The model `{RUNTIME}` does not exist.")
        twice = await http.post("/v1/unload_lora_adapter", json={"lora_name": RUNTIME})
        assert (twice.status_code, twice.json()["error"]["message"]) == \
            (404, f"The lora adapter '{RUNTIME}' cannot be found.")
        assert RUNTIME not in [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
    assert server.health_status() == 200


async def test_loading_a_missing_directory_is_not_found(server, tmp_path):
    async with server.http() as http:
        response = await http.post("/v1/load_lora_adapter",
                                   json={"lora_name": "ghost", "lora_path": str(tmp_path / "missing")})
        assert response.status_code == 404
        assert response.json()["error"]["message"].startswith("No adapter found at")
        assert "ghost" not in [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
    assert server.health_status() == 200
