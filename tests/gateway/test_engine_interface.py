"""worker.engine_interface.EngineInterface: exactly what the worker process uses of an engine, and every
engine the worker can serve (the real one and the two stand-ins) defines all of it with the same parameters; the
stand-ins, which subclass it, may keep a method's default (launch_delay, has_background_work, idle_poll)."""
from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import worker.__main__ as worker_main
from tests.gateway import fake_engine
from worker.engine_interface import EngineInterface

ENGINES = ["worker.engine:Engine", "bench.fast_engine:FastEngine", f"{fake_engine.__name__}:FakeEngine"]
STAND_INS = ENGINES[1:]
METHODS = sorted(name for name, value in vars(EngineInterface).items()
                 if inspect.isfunction(value) and not name.startswith("_"))
DEFAULTED = [name for name in METHODS if not getattr(vars(EngineInterface)[name], "__isabstractmethod__", False)]
PROPERTIES = sorted(name for name, value in vars(EngineInterface).items() if isinstance(value, property))
ATTRIBUTES = sorted(EngineInterface.__annotations__)


def bound_attributes(cls: type) -> set[str]:
    """Names bound in the class body, or assigned as `self.name = ...` in any of its methods."""
    class_def = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    names = set()
    for statement in class_def.body:
        if isinstance(statement, ast.Assign):
            names.update(t.id for t in statement.targets if isinstance(t, ast.Name))
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    for node in ast.walk(class_def):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def engine_members_used_by_the_worker() -> set[str]:
    """`engine.X` reads and `getattr(engine, "X", ...)` calls in worker/__main__.py."""
    tree = ast.parse(Path(worker_main.__file__).read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine":
            used.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "engine":
            used.add(node.args[1].value)
    return used


def parameters(function) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def test_interface_is_exactly_what_the_worker_uses():
    assert set(METHODS) | set(PROPERTIES) | set(ATTRIBUTES) == engine_members_used_by_the_worker()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", METHODS)
def test_engine_defines_each_method_with_the_interface_parameters(engine, method):
    cls = worker_main.load_factory(engine)
    implementation = getattr(cls, method)
    if not (engine in STAND_INS and method in DEFAULTED):     # a stand-in may keep a default
        assert implementation is not getattr(EngineInterface, method), f"{engine} does not define {method}"
    assert parameters(implementation) == parameters(getattr(EngineInterface, method))


def test_only_launch_delay_and_the_idle_work_have_defaults():
    assert DEFAULTED == ["has_background_work", "idle_poll", "launch_delay", "settle_adapters"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", PROPERTIES)
def test_engine_defines_each_property(engine, name):
    member = getattr(worker_main.load_factory(engine), name)
    assert isinstance(member, property) and member is not getattr(EngineInterface, name)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ATTRIBUTES)
def test_engine_binds_each_attribute(engine, name):
    assert name in bound_attributes(worker_main.load_factory(engine))


@pytest.mark.parametrize("engine", STAND_INS)
def test_stand_ins_declare_the_interface(engine):
    assert EngineInterface in worker_main.load_factory(engine).__mro__


def test_interface_imports_no_torch():
    code = "import sys, worker.engine_interface; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
