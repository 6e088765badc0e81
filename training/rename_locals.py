"""Short names for the local variables of functions, in the text a record ships (training.minify).

A local's name is invisible outside its function, except to code that asks for it by name, so a function keeps
its parameters (callers pass them by keyword; Triton and torch.library read them), its nested functions' and
classes' names, and every name that a nested function, lambda or class mentions (a closure reads it by name).
A function that calls locals(), vars(), eval() or exec(), or holds a match statement, keeps all of its names.
The new names appear nowhere else in the module and are no builtin: a function's first-used local becomes `a` (or
the first letter the module leaves free), its next `b`, and so on, the same letters in every function, which the
compressor then finds again and again.

What a rename may break, it breaks loudly in the tests: tests/test_minify.py runs renamed modules beside the
originals and a Triton kernel served from a record, tests/test_export_record.py retrains a run from a record.
"""
from __future__ import annotations

import ast
import builtins
import keyword
import string
from collections import Counter

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_DYNAMIC = frozenset({"locals", "vars", "eval", "exec"})
_RESERVED = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)


def _identifiers(node: ast.AST) -> set[str]:
    """Every identifier written in `node`: names, attributes, parameters, keywords, imports, defs."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.arg):
            found.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            found.add(n.arg)
        elif isinstance(n, ast.alias):
            found.update((n.asname or n.name).split("."))
            found.update(n.name.split("."))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            found.update(n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            found.add(n.name)
    return found


def _own_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[ast.AST], list[ast.AST]]:
    """(the nodes of `function`'s body in its own scope, comprehensions included; the nested scopes met)."""
    own, nested, todo = [], [], list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, _SCOPES):
            nested.append(node)
            continue
        own.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return own, nested


def _renamable(function: ast.FunctionDef | ast.AsyncFunctionDef, own: list[ast.AST], nested: list[ast.AST]) -> Counter:
    """{local name: uses} of the names `function` may rename."""
    if any(isinstance(n, ast.Match) or (isinstance(n, ast.Call) and getattr(n.func, "id", None) in _DYNAMIC)
           for n in own):
        return Counter()
    names = Counter(n.id for n in own if isinstance(n, ast.Name))
    names.update(n.name for n in own if isinstance(n, ast.ExceptHandler) and n.name)
    targets, by_comprehensions, inside = set(), set(), Counter()
    for comp in (n for n in own if isinstance(n, _COMPREHENSIONS)):
        bound = {n for gen in comp.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        targets |= {id(n) for n in bound}
        by_comprehensions |= {n.id for n in bound}
        first_iter = {id(n) for n in ast.walk(comp.generators[0].iter)}  # evaluated outside the comprehension
        inside.update(n.id for n in ast.walk(comp) if isinstance(n, ast.Name) and n.id in {b.id for b in bound}
                      and id(n) not in first_iter)
    local = {n.id for n in own if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) and id(n) not in targets}
    local |= {n.name for n in own if isinstance(n, ast.ExceptHandler) and n.name}
    # A name that only comprehensions bind may be read outside them too, as a global or a builtin: renamed only when
    # every use is inside one that binds it (one nested in another that binds it too counts twice, and is kept).
    local |= {name for name in by_comprehensions - local if inside[name] == names[name]}
    keep = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    keep |= {name for n in own if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
    keep |= {(n.asname or n.name).split(".")[0] for n in own if isinstance(n, ast.alias)}
    keep |= {name for scope in nested for name in _identifiers(scope)} | {s.name for s in nested if hasattr(s, "name")}
    return Counter({name: uses for name, uses in names.items()
                    if name in local and name not in keep and not name.startswith("__")})


def _fresh_names(taken: set[str]):
    letters = string.ascii_lowercase + string.ascii_uppercase
    width = 1
    while True:
        for i in range(len(letters) ** width):
            name, j = "", i
            for _ in range(width):
                name, j = letters[j % len(letters)] + name, j // len(letters)
            if name not in taken and name not in _RESERVED:
                yield name
        width += 1


def rename_locals(tree: ast.Module) -> ast.Module:
    """`tree` with each function's renamable locals given short fresh names (in place; returned)."""
    taken = _identifiers(tree)
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        own, nested = _own_nodes(function)
        uses = _renamable(function, own, nested)
        new = dict(zip((name for name, _ in uses.most_common()), _fresh_names(taken)))
        for node in own:
            if isinstance(node, ast.Name) and node.id in new:
                node.id = new[node.id]
            elif isinstance(node, ast.ExceptHandler) and node.name in new:
                node.name = new[node.name]
    return tree
