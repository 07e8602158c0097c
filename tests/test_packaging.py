"""setup.py's entry points resolve: the `erpo` console script and verl's plugin hook name importable objects (a
fresh install writes a script that imports exactly these strings)."""
import ast
import importlib
import importlib.util
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "setup.py"


def entry_points() -> dict:
    call = next(node for node in ast.walk(ast.parse(SETUP.read_text())) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))


def test_console_script_names_an_importable_function():
    (script,) = entry_points()["console_scripts"]
    name, target = script.split("=")
    module, attr = target.split(":")
    assert name == "erpo"
    assert callable(getattr(importlib.import_module(module), attr))


def test_verl_plugin_names_a_module():
    for spec in entry_points()["verl.plugins"]:
        module = spec.split("=")[1]
        assert importlib.util.find_spec(module) is not None, module
