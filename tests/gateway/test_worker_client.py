"""WorkerClient against a real spawned worker process running the fake engine."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest

from gateway.worker_client import SHUTTING_DOWN, WorkerClient, WorkerStartupError
from tests.gateway import fake_engine
from worker.config import ModelConfig, SchedulerConfig, WorkerConfig
from worker.ipc.messages import AddRequest, Ready, RequestOutput, SamplingParams

FAKE = f"{fake_engine.__name__}:FakeEngine"
FAILING = f"{fake_engine.__name__}:FailingEngine"
CONFIG = WorkerConfig(model=ModelConfig(path="unused"))
REPO = Path(__file__).resolve().parents[2]


def own_segments(pid: int | None = None) -> list[str]:
    prefix = f"lpx_{pid or os.getpid()}_"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run_gateway(report: Connection) -> None:
    """A gateway process that starts a worker, reports its pid, then idles until killed."""
    async def serve() -> None:
        client = WorkerClient(CONFIG, engine_factory=FAKE)
        await client.start()
        report.send(client.pid)
        await asyncio.sleep(60)
    asyncio.run(serve())


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [(sum(prompt) + i) % fake_engine.VOCAB_SIZE for i in range(max_tokens)]


def add_request(request_id: str, prompt: list[int], max_tokens: int, lora_name: str | None = None) -> AddRequest:
    return AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), lora_name)


async def collect(client: WorkerClient, request: AddRequest) -> list[RequestOutput]:
    return [output async for output in client.generate(request)]


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def client():
    client = WorkerClient(CONFIG, engine_factory=FAKE)
    await client.start()
    yield client
    await client.shutdown()
    assert own_segments() == []


async def test_start_returns_the_engine_ready_message(client):
    assert client.ready == Ready(fake_engine.MAX_MODEL_LEN, fake_engine.VOCAB_SIZE, fake_engine.EOS_TOKEN_IDS,
                                 fake_engine.NUM_KV_BLOCKS)
    assert client.healthy


@pytest.mark.parametrize("prompt, max_tokens", [([5], 1), ([1, 2, 3], 7), ([999, 998], 12)])
async def test_generate_yields_engine_tokens_then_finishes(client, prompt, max_tokens):
    outputs = await collect(client, add_request("r", prompt, max_tokens))
    assert [t for o in outputs for t in o.new_token_ids] == expected_tokens(prompt, max_tokens)
    assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + ["length"]
    assert all(o.num_prompt_tokens == len(prompt) for o in outputs)


@pytest.mark.parametrize("ring_bytes", [1 << 16, 512])   # 512: both rings fill up (backpressure)
async def test_concurrent_generates_get_only_their_own_tokens(ring_bytes):
    client = WorkerClient(WorkerConfig(model=ModelConfig(path="unused"), scheduler=SchedulerConfig(max_num_seqs=8)),
                          engine_factory=FAKE, ring_bytes=ring_bytes)
    await client.start()
    prompts = {f"req-{i}": [i, 3 * i, 7] for i in range(32)}
    lengths = {f"req-{i}": 1 + i % 9 for i in range(32)}
    results = await asyncio.gather(*(collect(client, add_request(rid, prompts[rid], lengths[rid]))
                                     for rid in prompts))
    await client.shutdown()
    for rid, outputs in zip(prompts, results):
        assert {o.request_id for o in outputs} == {rid}
        assert [t for o in outputs for t in o.new_token_ids] == expected_tokens(prompts[rid], lengths[rid])
        assert outputs[-1].finish_reason == "length"
    assert own_segments() == []


async def test_closing_generate_early_aborts_the_request(client):
    stream = client.generate(add_request("endless", [4, 2], max_tokens=10**9))
    first = await anext(stream)
    assert first.new_token_ids == expected_tokens([4, 2], 1)
    await wait_until(lambda: client.stats.num_running == 1)
    await stream.aclose()                       # the HTTP client went away
    await wait_until(lambda: client.stats.num_running == 0)
    assert client.stats.num_waiting == 0


async def test_cancelled_generate_aborts_the_request(client):
    async def consume():
        async for _ in client.generate(add_request("endless", [1], max_tokens=10**9)):
            pass
    task = asyncio.create_task(consume())
    await wait_until(lambda: client.stats.num_running == 1)
    task.cancel()
    await wait_until(lambda: client.stats.num_running == 0)


def ring_resident_kb() -> int:
    """Resident kB of this process's mappings of its own rings (/dev/shm/lpx_<pid>_...)."""
    resident, in_ring = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[0].isupper():                       # a mapping's header line: address range, ..., path
            in_ring = f"/dev/shm/lpx_{os.getpid()}_" in line
        elif in_ring and line.startswith("Rss:"):
            resident += int(line.split()[1])
    return resident


async def test_requests_leave_no_state_and_ring_memory_stays_at_the_rings_size():
    """Finished, closed and refused requests and adapter commands leave nothing behind, and the rings' pages
    are resident from the start (shm_ring maps them all), so ring memory never grows."""
    ring_bytes = 1 << 15
    client = WorkerClient(CONFIG, engine_factory=FAKE, ring_bytes=ring_bytes)
    await client.start()
    sizes = []
    for i in range(80):                               # both rings go round by about the 30th
        await collect(client, add_request(f"whole-{i}", [i, 7], max_tokens=8))
        await collect(client, add_request(f"refused-{i}", [i], max_tokens=8, lora_name=f"ghost-{i}"))
        cut = client.generate(add_request(f"cut-{i}", [i], max_tokens=10**9))
        await anext(cut)
        await cut.aclose()
        await client.adapter_command("load", f"adapter-{i}", f"/adapters/{i}")
        await client.adapter_command("unload", f"adapter-{i}")
        sizes.append(ring_resident_kb())
    assert (client._queues, client._commands, len(client._backlog)) == ({}, {}, 0)
    await client.shutdown()
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    ring_kb = -(-(ring_bytes // 1024 + 1) // page_kb) * page_kb     # data and header, in whole pages
    assert sizes == [2 * ring_kb] * 80


async def test_engine_rejection_ends_the_request_with_its_error(client):
    outputs = await collect(client, add_request("bad", [], max_tokens=4))
    assert outputs == [RequestOutput("bad", [], finish_reason="error", error="The prompt is empty.", status_code=400)]
    outputs = await collect(client, add_request("no-adapter", [1, 2], max_tokens=4, lora_name="ghost"))
    assert outputs == [RequestOutput("no-adapter", [], finish_reason="error", num_prompt_tokens=2,
                                     error="The lora adapter 'ghost' cannot be found.", status_code=404)]


async def test_adapter_commands_report_engine_results(client):
    loaded = await client.adapter_command("load", "sql", "/adapters/sql")
    again = await client.adapter_command("load", "sql", "/adapters/sql")
    inplace = await client.adapter_command("load", "sql", "/adapters/sql-v2", load_inplace=True)
    unloaded = await client.adapter_command("unload", "sql")
    missing = await client.adapter_command("unload", "sql")
    bogus = await client.adapter_command("merge", "sql")
    assert [(r.ok, r.status_code) for r in (loaded, again, inplace, unloaded, missing, bogus)] == [
        (True, 200), (False, 400), (True, 200), (True, 200), (False, 404), (False, 400)]
    assert again.message == "The lora adapter 'sql' has already been loaded."
    assert missing.message == "The lora adapter 'sql' cannot be found."
    assert len({r.command_id for r in (loaded, again, inplace, unloaded, missing, bogus)}) == 6


async def test_adapter_list_reports_the_engine_states(client):
    assert (await client.adapter_command("load", "sql", "/adapters/sql", pinned=True)).ok
    assert (await client.adapter_command("load", "sql", "/adapters/sql-v2", load_inplace=True)).ok
    listed = await client.adapter_command("list", "")
    assert listed.ok
    assert [(a.name, a.path, a.version, a.pinned) for a in listed.adapters] == [("sql", "/adapters/sql-v2", 2, False)]


async def test_stats_name_running_adapters(client):
    assert (await client.adapter_command("load", "sql", "/adapters/sql")).ok
    stream = client.generate(add_request("lora", [3], max_tokens=10**9, lora_name="sql"))
    await anext(stream)
    await wait_until(lambda: client.stats.running_adapters == ["sql"])
    await stream.aclose()
    await wait_until(lambda: client.stats.running_adapters == [])


async def test_stats_carry_the_engines_kv_cache_usage(client):
    stream = client.generate(add_request("endless", [3], max_tokens=10**9))
    await anext(stream)
    await wait_until(lambda: client.stats.kv_cache_usage == 1 / fake_engine.NUM_KV_BLOCKS)
    await stream.aclose()
    await wait_until(lambda: client.stats.kv_cache_usage == 0.0)
    assert client.stats.num_preemptions == 0


async def test_startup_failure_raises_the_worker_message():
    client = WorkerClient(CONFIG, engine_factory=FAILING)
    with pytest.raises(WorkerStartupError, match=f"RuntimeError: {fake_engine.STARTUP_ERROR}"):
        await client.start()
    assert not client.healthy
    assert own_segments() == []


async def test_killed_worker_ends_inflight_requests_with_an_error(client):
    stream = client.generate(add_request("victim", [9], max_tokens=10**9))
    await anext(stream)
    os.kill(client.pid, signal.SIGKILL)
    outputs = [output async for output in stream]
    assert outputs[-1] == RequestOutput("victim", [], finish_reason="error",
                                        error=f"The worker process died (exit code {-signal.SIGKILL}).")
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert not client.healthy and client.failed
    assert own_segments() == []
    after = await client.adapter_command("load", "sql", "/adapters/sql")
    assert (after.ok, after.status_code) == (False, 503)
    late = await collect(client, add_request("late", [1], 3))
    assert late == [RequestOutput("late", [], finish_reason="error", error=outputs[-1].error)]


async def test_shutdown_stops_the_worker_and_frees_shared_memory(client):
    assert len(own_segments()) == 2
    pid = client.pid
    await client.shutdown()
    assert not client.healthy and not client.failed
    assert own_segments() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def shutting_down(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], finish_reason="error", error=SHUTTING_DOWN, status_code=503)


async def test_requests_in_flight_finish_while_draining(client):
    running = asyncio.create_task(collect(client, add_request("running", [4], max_tokens=50)))
    await wait_until(lambda: client.stats.num_running == 1)
    drain = asyncio.create_task(client.drain(timeout=30))
    await asyncio.sleep(0)
    assert not client.healthy
    received_before = await collect(client, add_request("received-before", [5], max_tokens=3))
    outputs = await running
    assert [t for o in outputs for t in o.new_token_ids] == expected_tokens([4], 50)
    assert outputs[-1].finish_reason == "length"
    assert [t for o in received_before for t in o.new_token_ids] == expected_tokens([5], 3)
    assert not drain.done()
    drain.cancel()
    assert not client.failed


async def test_drain_ends_requests_left_at_the_timeout_and_refuses_later_ones(client):
    stream = client.generate(add_request("endless", [9], max_tokens=10**9))
    first = await anext(stream)
    start = asyncio.get_running_loop().time()
    await client.drain(timeout=0.3)
    assert asyncio.get_running_loop().time() - start >= 0.3
    rest = [output async for output in stream]
    assert rest[-1] == shutting_down("endless")
    assert first.finish_reason is None and all(o.finish_reason is None for o in rest[:-1])
    await wait_until(lambda: client.stats.num_running == 0)      # aborted in the worker
    assert await collect(client, add_request("late", [1], 3)) == [shutting_down("late")]
    refused = await client.adapter_command("load", "sql", "/adapters/sql")
    assert (refused.ok, refused.status_code, refused.message) == (False, 503, SHUTTING_DOWN)


async def test_worker_exits_when_the_gateway_dies():
    receive, report = multiprocessing.get_context("spawn").Pipe(duplex=False)
    gateway = multiprocessing.get_context("spawn").Process(target=run_gateway, args=(report,))
    gateway.start()
    assert receive.poll(20), "the gateway process did not report its worker"
    worker_pid = receive.recv()
    assert not process_gone(worker_pid)
    gateway.kill()
    gateway.join()
    await wait_until(lambda: process_gone(worker_pid))
    for name in own_segments(gateway.pid):     # the killed owner could not unlink them
        SharedMemory(name).unlink()


def test_importing_the_client_leaves_torch_out():
    code = "import sys, gateway.worker_client; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
