"""The form a record's train_gpt.py packs each module in: the same program without its docstrings, comments and
function annotations, written back by ast.unparse.

A record counts the bytes of its train_gpt.py, and prose is most of a module's text: the parse tree keeps what the
interpreter runs and drops the rest (comments never reach it; ast.unparse writes none). Kept on purpose:
- class-level annotations: they are dataclass fields and NamedTuple members, which the code reads;
- the annotations of every decorated function: decorators read them (Triton's jit: `BLOCK: tl.constexpr` is part
  of a kernel; torch.library.triton_op infers an operator's schema from its function's annotations);
- string statements that are not the first of a body (they are not docstrings, and nothing here writes them).
strip_source checks that its result parses back to the stripped tree (tests/test_minify.py also runs stripped
modules beside the originals).
"""
from __future__ import annotations

import ast

_BODIES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _drop_annotations(node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    node.returns = None
    args = node.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None


def strip_source(source: str, where: str = "<source>") -> str:
    """`source` without docstrings, comments and the annotations of undecorated functions."""
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, _BODIES) and node.body and _is_docstring(node.body[0]):
            node.body = node.body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            _drop_annotations(node)
    text = ast.unparse(tree)
    if ast.dump(ast.parse(text, where)) != ast.dump(tree):  # unparse is not exact for every tree: never ship a change
        raise ValueError(f"{where}: its stripped text does not parse back to the stripped program")
    return text + "\n" if text else ""
