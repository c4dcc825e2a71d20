"""Constrained decoding and token bans in the engine, on the demo model (its fast size, real tokenizer)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.structured_cases import CLOSERS, ENDS_EARLY, REGEX, SCHEMAS, SPECS, check, ending_bias
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.demo import ADAPTERS
from worker.engine import Engine
from worker.ipc.messages import SamplingParams, StructuredOutput
from worker.structured.structured_outputs import token_bitmask_row

ADAPTER_NAMES = [None] + [a.name for a in ADAPTERS[:2]]


def make_engine(demo, async_scheduling: bool = True) -> Engine:
    engine = Engine(WorkerConfig(ModelConfig(str(demo.model_dir)),
                                 cache=CacheConfig(block_size=4, num_gpu_blocks_override=512),
                                 lora=LoRAConfig(max_loras=2, max_lora_rank=16),
                                 scheduler=SchedulerConfig(max_num_seqs=16), device="cpu",
                                 async_scheduling=async_scheduling))
    for name, path in demo.adapters.items():
        engine.add_adapter(name, str(path))
    return engine


@pytest.fixture(scope="module")
def engine(demo):
    return make_engine(demo)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, str | None]]) -> dict[str, list]:
    for request_id, (prompt, params, adapter) in requests.items():
        engine.add_request(request_id, prompt, params, adapter)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def text_of(tokenizer, outs, eos: int) -> str:
    ids = [t for o in outs for t in o.new_token_ids if t != eos]
    return tokenizer.decode(ids, skip_special_tokens=False)


def constrained(kind: str, spec: str, seed: int, any_whitespace: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                          logit_bias=CLOSERS if kind == "json_object" else None,
                          structured=StructuredOutput(kind, spec, any_whitespace))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_constrained_output_follows_its_spec_in_a_mixed_batch(demo, tokenizer, async_scheduling):
    """Constrained requests of every kind, with and without adapters, beside unconstrained ones; every
    constrained output ends (eos) and follows its spec."""
    engine = make_engine(demo, async_scheduling)
    eos = engine.eos_token_ids[0]
    requests = {}
    for i, (kind, spec) in enumerate(SPECS):
        for seed in range(2):
            adapter = ADAPTER_NAMES[(i + seed) % len(ADAPTER_NAMES)]
            requests[f"{kind}-{i}-{seed}"] = (tokenizer.encode(f"case {i} {seed}").ids, constrained(kind, spec, seed),
                                              adapter)
    for j in range(4):
        requests[f"free-{j}"] = (tokenizer.encode(f"free text {j}").ids,
                                 SamplingParams(max_tokens=30, temperature=1.0, seed=j), ADAPTER_NAMES[j % 3])
    outputs = run(engine, requests)
    for request_id, (_, params, _) in requests.items():
        outs = outputs[request_id]
        assert outs[-1].finish_reason in ("stop", "length") and outs[-1].error is None
        if params.structured is not None:
            assert outs[-1].finish_reason == "stop", request_id
            check(params.structured.kind, params.structured.spec, text_of(tokenizer, outs, eos))


def test_any_whitespace_json_still_validates(engine, tokenizer):
    eos = engine.eos_token_ids[0]
    spec = json.dumps(SCHEMAS["enum"])
    outputs = run(engine, {f"ws-{s}": (tokenizer.encode("ws").ids, constrained("json", spec, s, True), None)
                           for s in range(3)})
    for outs in outputs.values():
        if outs[-1].finish_reason == "stop":        # any whitespace may run past max_tokens on a small model
            check("json", spec, text_of(tokenizer, outs, eos))


def test_constrained_tokens_match_alone_and_in_a_batch(engine, tokenizer):
    """A seeded constrained request samples the same tokens alone and beside others."""
    spec = json.dumps(SCHEMAS["nested"])
    alone = run(engine, {"a": (tokenizer.encode("x").ids, constrained("json", spec, 7), None)})["a"]
    mixed = run(engine, {"b": (tokenizer.encode("x").ids, constrained("json", spec, 7), None),
                         "c": (tokenizer.encode("y").ids, SamplingParams(max_tokens=20, seed=1), None),
                         "d": (tokenizer.encode("z").ids, constrained("regex", REGEX, 3), "doctests")})["b"]
    assert [o.new_token_ids for o in alone] == [o.new_token_ids for o in mixed]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("kind, spec, forced", ENDS_EARLY)
def test_after_its_grammar_ends_an_ignore_eos_request_takes_end_tokens_until_max_tokens(
        demo, tokenizer, caplog, kind, spec, forced, async_scheduling):
    """With ignore_eos a constrained request goes on past its grammar's end to max_tokens (finish reason "length", as
    vLLM's does), min_tokens or not, and only end-of-sequence tokens follow the end, so its text stays a match; an
    unconstrained row would take "Z" there. Without ignore_eos the same request stops at the end."""
    engine = make_engine(demo, async_scheduling)
    eos = engine.eos_token_ids[0]
    forced_ids = [tokenizer.token_to_id(c) for c in forced]

    def params(**fields) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0.0, logit_bias=ending_bias(tokenizer, forced, eos),
                              structured=StructuredOutput(kind, spec), **fields)
    prompt = tokenizer.encode("end").ids
    outputs = run(engine, {"ignore": (prompt, params(ignore_eos=True), None),
                           "ignore-min": (prompt, params(ignore_eos=True, min_tokens=12), "chat"),
                           "stop": (prompt, params(), None)})
    for request_id, outs in outputs.items():
        tokens = [t for o in outs for t in o.new_token_ids]
        check(kind, spec, tokenizer.decode(tokens))          # the end tokens are special: no text
        if request_id == "stop":
            assert (tokens, outs[-1].finish_reason) == (forced_ids + [eos], "stop")
        else:
            assert (tokens, outs[-1].finish_reason) == (forced_ids + [eos] * (12 - len(forced)), "length")
    assert "does not follow its grammar" not in caplog.text


def test_a_token_bitmask_row_allows_its_tokens_alone():
    row = token_bitmask_row([2, 33, 63], 64)
    assert row.dtype == torch.int32 and row.tolist() == [0b100, 0b10 - (1 << 31)]     # bit 31 is the sign bit
    assert [t for t in range(64) if row[t // 32] >> (t % 32) & 1] == [2, 33, 63]


@pytest.mark.parametrize("kind, spec, message", [
    ("json", '{"type": "foo"}', 'Invalid JSON schema: Unsupported type "foo"'),
    ("json", "not json", "Invalid JSON schema: Failed to parse JSON"),
    ("regex", "(ab", "Invalid regex"),
    ("grammar", 'start ::= "a"', 'The root rule with name "root" is not found'),
    # no output satisfies these: each is a 400 rather than a request served unconstrained
    ("grammar", 'root ::= x\nx ::= y\ny ::= x', "no output satisfies it: rule(s) `root`, `x`, `y` never end"),
    ("grammar", 'root ::= root "a"', "no output satisfies it: rule(s) `root` never end"),
    ("grammar", 'root ::= "a" x\nx ::= "b" x', "no output satisfies it: rule(s) `root`, `x` never end"),
    ("json", '{"$ref": "#"}', "Invalid JSON schema: no output satisfies it: every value must hold itself"),
    ("json", '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
     "Invalid JSON schema: no output satisfies it"),
    ("json", '{"type": "array", "items": {"$ref": "#"}, "minItems": 1}', "Invalid JSON schema: no output satisfies"),
    ("json", '{"$ref": "https://example.com/s.json"}', "`$ref` 'https://example.com/s.json' is not supported"),
    ("json", '{"properties": {"a": {"$ref": "other.json#/x"}}}', "`$ref` 'other.json#/x' is not supported"),
    ("json", '{"enum": []}', "Invalid JSON schema: enum array must not be empty"),
    ("json", '{"anyOf": []}', "`anyOf` must be a non-empty array"),
    ("json", '{"type": []}', "`type` is an empty array"),
    ("json", '{"not": {}}', "`not` of a schema that admits every value admits no value"),
    ("json", '{"type": "array", "minItems": 3, "maxItems": 1}', "minItems is greater than maxItems: 3 > 1"),
    ("json", '{"type": "string", "minLength": 5, "maxLength": 2}', "minLength 5 is greater than maxLength 2"),
    ("json", '{"type": "object", "required": ["a"], "additionalProperties": false}', "Required property 'a'"),
    ("json", 'false', "Schema 'false' cannot accept any value"),
])
def test_bad_spec_ends_the_request_with_a_400_and_others_go_on(engine, tokenizer, kind, spec, message):
    outputs = run(engine, {"bad": (tokenizer.encode("x").ids, constrained(kind, spec, 0), None),
                           "good": (tokenizer.encode("y").ids, SamplingParams(max_tokens=5), None)})
    bad = outputs["bad"][-1]
    assert bad.finish_reason == "error" and bad.status_code == 400 and message in bad.error
    assert outputs["good"][-1].finish_reason == "length"


@pytest.mark.parametrize("kind, spec", [
    ("grammar", 'root ::= "a" | root "b"'),                  # left recursion with a base case
    ("grammar", 'root ::= x?\nx ::= x'),                     # the unending rule is optional
    ("json", '{"type": "object", "properties": {"a": {"$ref": "#"}}}'),      # a tree: the child is optional
    ("json", '{"type": "array", "items": {"$ref": "#"}}'),   # nested arrays end with []
    ("json", '{"type": "object", "properties": {"not": {}, "$ref": {"type": "string"}}, "required": ["not"]}'),
])
def test_a_spec_with_a_way_out_compiles(demo, kind, spec):
    from worker.structured.compiler import GrammarCompiler
    compiler = GrammarCompiler(str(demo.model_dir), 1536, [2])
    try:
        assert compiler.submit(StructuredOutput(kind, spec)).result(timeout=60) is not None
    finally:
        compiler.close()


def test_abort_while_compiling_ends_the_request(engine, tokenizer):
    engine.add_request("held", tokenizer.encode("x").ids, constrained("json", json.dumps(SCHEMAS["array"]), 0))
    out = engine.abort_request("held")
    assert out.finish_reason == "abort"
    assert run(engine, {}) == {} and not engine.has_unfinished()


def test_logit_bias_bans_and_forces_tokens(engine, tokenizer):
    prompt = tokenizer.encode("hello world").ids
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = [t for o in run(engine, {"p": (prompt, greedy, None)})["p"] for t in o.new_token_ids]
    banned = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={plain[0]: -100.0})
    forced = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True, logit_bias={77: 100.0})
    outputs = run(engine, {"ban": (prompt, banned, None), "force": (prompt, forced, "chat")})
    assert plain[0] not in [t for o in outputs["ban"] for t in o.new_token_ids]
    assert [t for o in outputs["force"] for t in o.new_token_ids] == [77] * 8


def test_allowed_token_ids_and_bad_words(engine, tokenizer):
    prompt = tokenizer.encode("hello").ids
    allowed = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[5, 9, 40])
    plain = [t for o in run(engine, {"p": (prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                           None)})["p"] for t in o.new_token_ids]
    bad = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, bad_words_token_ids=[[plain[0]]])
    outputs = run(engine, {"allowed": (prompt, allowed, None), "bad": (prompt, bad, None)})
    assert set(t for o in outputs["allowed"] for t in o.new_token_ids) <= {5, 9, 40}
    assert plain[0] not in [t for o in outputs["bad"] for t in o.new_token_ids]


@pytest.mark.parametrize("params, message", [
    (dict(logit_bias={99999: 1.0}), "token_id(s) [99999] in logit_bias contain out-of-vocab token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(allowed_token_ids=[1, 99999]), "allowed_token_ids contains out-of-vocab token id!"),
    (dict(bad_words_token_ids=[[1, 99999]]), "the following tokens were specified as bad: [99999]"),
])
def test_out_of_vocab_token_fields_are_refused(engine, params, message):
    with pytest.raises(ValueError) as e:
        engine.add_request("oov", [1, 2], SamplingParams(**params))
    assert message in str(e.value)


def test_a_spec_is_compiled_once_and_shared(demo):
    from worker.structured.compiler import GrammarCompiler
    compiler = GrammarCompiler(str(demo.model_dir), 1536, [2])
    try:
        first = compiler.submit(StructuredOutput("regex", "[ab]+"))
        assert compiler.submit(StructuredOutput("regex", "[ab]+")) is first
        assert compiler.submit(StructuredOutput("regex", "[ab]+", any_whitespace=False)) is not first
        assert first.result(timeout=60) is not None
    finally:
        compiler.close()


def test_async_scheduling_gives_the_constrained_tokens_of_synchronous_steps(demo, tokenizer):
    """With async scheduling a constrained row's pending token is filed before the row samples; its tokens, and
    those of the free rows beside it (penalties read the filed tokens), are the synchronous engine's. Each engine
    compiles the grammars first, so both admit every request at the first step and run the same batches."""
    requests = {f"c{i}": (tokenizer.encode(f"p{i}").ids, constrained(kind, spec, i), ADAPTER_NAMES[i % 3])
                for i, (kind, spec) in enumerate(SPECS)}
    requests.update({f"f{j}": (tokenizer.encode(f"q{j}").ids,
                               SamplingParams(max_tokens=25, seed=j, presence_penalty=0.5), ADAPTER_NAMES[j % 3])
                     for j in range(3)})
    tokens = []
    for async_scheduling in (True, False):
        engine = make_engine(demo, async_scheduling)
        run(engine, {f"warm-{rid}": r for rid, r in requests.items() if rid.startswith("c")})
        outputs = run(engine, requests)
        tokens.append({rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()})
    assert tokens[0] == tokens[1] and len(tokens[0]) == len(requests)


def test_length_bounded_json_strings_refuse_control_characters(demo, tokenizer):
    """xgrammar lowers a string with maxLength/minLength to a character class that admits the raw control
    characters U+0000-U+001F (mlc-ai/xgrammar#800): a GPU run answered '{"name": "}\\x01xt"}' to SCHEMAS["string"],
    which json.loads refuses. The compiled grammar bans every control-character token inside such a string."""
    import xgrammar

    from worker.structured.compiler import GrammarCompiler
    compiler = GrammarCompiler(str(demo.model_dir), 1536, [2])
    try:
        grammar = compiler.submit(StructuredOutput("json", json.dumps(SCHEMAS["string"]), False)).result(timeout=60)
    finally:
        compiler.close()
    matcher = xgrammar.GrammarMatcher(grammar)
    assert all(matcher.accept_token(t) for t in tokenizer.encode('{"name": "}').ids)
    bitmask = xgrammar.allocate_token_bitmask(1, 1536)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = [t for t in range(1536) if bitmask[0, t // 32] >> (t % 32) & 1]
    control = [tokenizer.token_to_id(chr(0x100 + b)) for b in range(0x20)]   # byte-level BPE: byte b is U+0100 + b
    assert None not in control and not set(control) & set(allowed)
    assert tokenizer.token_to_id("x") in allowed
    assert not matcher.accept_token(tokenizer.token_to_id("\u0101"))          # "\x01"


def test_graph_capture_collects_garbage_first_and_runs_no_gc_during_it(monkeypatch):
    """A dropped engine left in a reference cycle was freed by the cyclic GC in the middle of the next engine's
    CUDA graph capture; its graphs' destructors made CUDA calls a capture does not permit, which invalidated it
    ("operation failed due to a previous error during capture"). capture() collects before, and not during."""
    import gc

    from worker.model_runner.cuda_graph import CUDAGraphRunner
    state = {"capturing": False, "freed_while_capturing": []}

    class DroppedEngine:              # unreachable but in a cycle: only the cyclic GC frees it
        def __init__(self):
            self.cycle = self

        def __del__(self):
            state["freed_while_capturing"].append(state["capturing"])

    def capture_one(kind, size, lora):
        state["capturing"] = True
        objects = [[] for _ in range(20_000)]      # enough allocations to trigger automatic collections
        state["capturing"] = False
        return objects, None

    runner = CUDAGraphRunner(None, None, None, max_num_seqs=2)
    monkeypatch.setattr(runner, "_capture", capture_one)
    DroppedEngine()
    runner.capture()
    assert state["freed_while_capturing"] == [False] and len(runner.graphs) == 4
    assert gc.isenabled()


def test_the_grammar_compiler_is_made_when_the_engine_starts_not_by_the_first_constrained_request(demo):
    """xgrammar's imports and the tokenizer's vocabulary take the interpreter for seconds: made by the first
    constrained request, they held every request beside it up (a plain request waited ~1.4 s beside the first one on
    the demo). The engine starts that work while its model loads, on the compiler's thread, and is ready only once
    it is done."""
    engine = make_engine(demo)
    made = engine.structured._compiler._compiler          # the compiler's future, started by the engine
    assert made.done() and made.result() is not None      # done before the engine returned, unasked
    assert engine.structured.num_compiling == 0


def _allowed(row: torch.Tensor) -> list[int]:
    """The token ids a bitmask row allows."""
    words = row.numpy().view("uint32").astype("int64")
    return [w * 32 + b for w in range(len(words)) for b in range(32) if words[w] >> b & 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="page-locked rows and their copies need a GPU"))])
def test_a_steps_bitmask_equals_each_matcher_filled_alone(demo, device):
    """StructuredOutputs.bitmask (batched accepts and fills, reused host rows) against a reference: for each row an
    xgrammar matcher of its own, advanced token by token and filled alone. Rows: fresh, advanced one token a step
    (the batched accept), advanced two tokens at once (one at a time), past its grammar's end, broken by a refused
    token, finished, and without a grammar; three steps, so the two host buffers are each reused."""
    import xgrammar
    from types import SimpleNamespace
    from worker.structured.structured_outputs import StructuredOutputs
    arch = json.loads((demo.model_dir / "config.json").read_text())
    vocab, eos = arch["vocab_size"], arch["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    structured = StructuredOutputs(str(demo.model_dir), vocab, eos_ids, torch.device(device), max_rows=2)
    structured.wait_ready()
    specs = {"fresh": ("regex", REGEX), "one": ("json", json.dumps(SCHEMAS["nested"])), "two": ("regex", REGEX),
             "ended": ("regex", "a"), "broken": ("regex", REGEX), "finished": ("regex", REGEX), "open": None}
    requests = {}
    for i, (name, spec) in enumerate(specs.items()):
        params = SimpleNamespace(structured=None if spec is None else StructuredOutput(*spec))
        requests[name] = SimpleNamespace(request_id=name, params=params, arrival_seq=i, is_finished=False,
                                         num_pending=0, output_token_ids=[])
        if spec is not None:
            structured.hold(requests[name])
    while structured.num_compiling:
        structured.wait(1.0)
        structured.ready()
    grammars = {name: structured._compiler.submit(StructuredOutput(*spec)).result()
                for name, spec in specs.items() if spec is not None}
    reference = {name: xgrammar.GrammarMatcher(g) for name, g in grammars.items()}
    words = -(-vocab // 32)
    batch = SimpleNamespace(seqs=[SimpleNamespace(samples=True, request=r) for r in requests.values()])

    released = {"open"}                     # rows every token may follow

    def expected() -> torch.Tensor:
        rows = torch.full((len(requests), words), -1, dtype=torch.int32)
        for row, (name, request) in enumerate(requests.items()):
            if name in released:
                continue
            if reference[name].is_terminated():
                rows[row] = token_bitmask_row(eos_ids, vocab)
            else:
                reference[name].fill_next_token_bitmask(rows, row)
        return rows

    def advance(name: str, count: int) -> None:
        for _ in range(count):
            mask = torch.zeros((1, words), dtype=torch.int32)
            reference[name].fill_next_token_bitmask(mask, 0)
            token = next(t for t in _allowed(mask[0]) if t not in eos_ids or name == "ended")
            assert reference[name].accept_token(token)
            requests[name].output_token_ids.append(token)

    for step in range(3):
        got = structured.bitmask(batch).cpu()
        want = expected()
        assert torch.equal(got, want), (step, [n for i, n in enumerate(requests) if not torch.equal(got[i], want[i])])
        advance("one", 1)
        advance("two", 2)
        if step == 0:
            advance("ended", 1)                               # "a", then the end token
            requests["ended"].output_token_ids.append(eos_ids[0])
            assert reference["ended"].accept_token(eos_ids[0]) and reference["ended"].is_terminated()
            requests["broken"].output_token_ids.append(eos_ids[0])   # the grammar cannot end here
            requests["finished"].is_finished = True
            released |= {"broken", "finished"}
    assert structured._matchers["broken"].broken and not structured._matchers["one"].broken
    structured.close()
