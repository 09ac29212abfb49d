"""Every public function and method of shmseq, and every method of a ``typing.Protocol``, is
fully annotated: each parameter but ``self``/``cls``, and the return. mypy in CI checks the
bodies; this holds the rule itself whatever mypy's flags. Read from the source with ``ast``,
nothing imported.

Public: a module whose path has no part with a leading underscore (``__init__`` and
``__main__`` are public), a function or class whose name has none either (dunder methods such
as ``__init__`` and ``__call__`` of a public class count: they are its signature), not nested
in a function."""
import ast
from pathlib import Path

import shmseq

PACKAGE = Path(shmseq.__file__).parent


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, ".".join(parts), any(_private(part) for part in parts)


def _is_protocol(node):
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base  # Protocol[T]
        if (isinstance(target, ast.Name) and target.id == "Protocol") or (
                isinstance(target, ast.Attribute) and target.attr == "Protocol"):
            return True
    return False


def _missing(func, is_method):
    """The parameters of ``func`` without an annotation, and "return" if it has none."""
    args = func.args
    positional = args.posonlyargs + args.args
    decorators = {d.id for d in func.decorator_list if isinstance(d, ast.Name)}
    if is_method and positional and "staticmethod" not in decorators:
        positional = positional[1:]  # self, or cls
    every = positional + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    missing = [a.arg for a in every if a.annotation is None]
    if func.returns is None:
        missing.append("return")
    return missing


def _definitions(body, prefix, public, in_protocol):
    """(qualified name, function node, whether a method) for the functions of ``body`` the rule
    holds for, through classes but not into functions."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if in_protocol or (public and not _private(node.name)):
                yield prefix + node.name, node, bool(prefix)
        elif isinstance(node, ast.ClassDef):
            yield from _definitions(node.body, f"{prefix}{node.name}.",
                                    public and not _private(node.name), _is_protocol(node))
        elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` etc.
            blocks = [node.body, node.orelse] + (
                [node.finalbody] + [h.body for h in node.handlers] if isinstance(node, ast.Try)
                else [])
            for block in blocks:
                yield from _definitions(block, prefix, public, in_protocol)


def unannotated():
    found = []
    for path, module, private in _modules():
        tree = ast.parse(path.read_text(), str(path))
        for name, func, is_method in _definitions(tree.body, "", not private, False):
            missing = _missing(func, is_method)
            if missing:
                found.append(f"{module}.{name} (line {func.lineno}): {', '.join(missing)}")
    return found


def test_public_functions_and_protocol_methods_are_fully_annotated():
    assert unannotated() == []


def test_the_check_sees_what_it_should(tmp_path):
    """The walk itself: a missing parameter, return, or Protocol method is found; self, cls,
    private names, nested functions and static methods' first parameters are handled."""
    source = '''
from typing import Protocol
import typing

def good(a: int, *b: int, c: int = 1, **d: int) -> None: ...
def bad(a, b: int): ...
def _private(a): ...
def outer() -> None:
    def inner(a): ...
class C:
    def __init__(self, a): ...
    def m(self) -> int: ...
    @classmethod
    def k(cls, a: int) -> None: ...
    @staticmethod
    def s(a) -> None: ...
    def _hidden(self, a): ...
class _Hidden:
    def m(self, a): ...
class P(typing.Protocol):
    def _hook(self, a) -> None: ...
'''
    tree = ast.parse(source)
    found = {name: _missing(func, method) for name, func, method in
             _definitions(tree.body, "", True, False) if _missing(func, method)}
    assert found == {"bad": ["a", "return"], "C.__init__": ["a", "return"], "C.s": ["a"],
                     "P._hook": ["a"]}
