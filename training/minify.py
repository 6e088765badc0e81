"""The form a record's train_gpt.py packs each module in: the same program without its docstrings, comments and
function annotations, written back by ast.unparse, then laid out compactly (minify_source).

A record counts the bytes of its train_gpt.py, and prose is most of a module's text: the parse tree keeps what the
interpreter runs and drops the rest (comments never reach it; ast.unparse writes none). Kept on purpose:
- class-level annotations: they are dataclass fields and NamedTuple members, which the code reads;
- the annotations of every decorated function: decorators read them (Triton's jit: `BLOCK: tl.constexpr` is part
  of a kernel; torch.library.triton_op infers an operator's schema from its function's annotations);
- string statements that are not the first of a body (they are not docstrings, and nothing here writes them).
minify_source then gives functions' local variables short names (training.rename_locals), and compact_source
indents each level by one space and drops every space the tokens do not need (`x = f(a, b)` becomes `x=f(a,b)`):
the tree stays the same. Both check that their result parses back to the tree they meant
(tests/test_minify.py also runs minified modules beside the originals).
"""
from __future__ import annotations

import ast
import io
import token
import tokenize

from training.rename_locals import rename_locals

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
    return _unparse(tree, where, "stripped")


def _unparse(tree: ast.Module, where: str, what: str) -> str:
    text = ast.unparse(tree)
    if ast.dump(ast.parse(text, where)) != ast.dump(tree):  # unparse is not exact for every tree: never ship a change
        raise ValueError(f"{where}: its {what} text does not parse back to the {what} program")
    return text + "\n" if text else ""


def minify_source(source: str, where: str = "<source>") -> str:
    """What a record ships of a module: strip_source, its locals renamed (training.rename_locals), compact_source."""
    renamed = _unparse(rename_locals(ast.parse(strip_source(source, where), where)), where, "renamed")
    return compact_source(renamed, where)


# ----- compact layout: what the tokens need, no more -----

_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OPERATORS = tuple(token.EXACT_TOKEN_TYPES)  # every operator and delimiter the tokenizer knows
_FSTRING_START, _FSTRING_END = getattr(token, "FSTRING_START", -1), getattr(token, "FSTRING_END", -1)  # 3.12+


def _needs_space(before: str, after: str, before_is_number: bool) -> bool:
    """Whether `before` and `after`, written with nothing between them, would read as other tokens."""
    if before[-1] in _WORD and after[0] in _WORD:
        return True  # `return x`, `not a`; a string's prefix (f'…') is a letter too
    if (before_is_number and after[0] in _WORD | {"."}) or (before[-1] == "." and after[0].isdigit()):
        return True  # `1 if` (3.12 warns about `1if`), `1 .real`
    joined = before + after[0]
    return any(op.startswith(joined) for op in _OPERATORS)  # `* *` is not `**`, `. .` not `...`


def _logical_lines(text: str):
    """(indentation depth, [(token text, is a number)]) per logical line of `text`. An f-string, which Python 3.12
    tokenizes into parts, stays one token, copied from the text."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    depth, current, fstring_start, fstring_depth = 0, [], None, 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == _FSTRING_START:
            fstring_depth += 1
            fstring_start = fstring_start or tok.start
        elif tok.type == _FSTRING_END:
            fstring_depth -= 1
            if not fstring_depth:
                (r0, c0), (r1, c1) = fstring_start, tok.end
                current.append((text[offsets[r0 - 1] + c0:offsets[r1 - 1] + c1], False))
                fstring_start = None
        elif fstring_depth:
            continue
        elif tok.type == token.INDENT:
            depth += 1
        elif tok.type == token.DEDENT:
            depth -= 1
        elif tok.type in (token.NEWLINE, token.ENDMARKER):
            if current:
                yield depth, current
            current = []
        elif tok.type not in (token.NL, token.COMMENT):
            current.append((tok.string, tok.type == token.NUMBER))


def compact_source(text: str, where: str = "<source>") -> str:
    """`text` (one logical line per line, as ast.unparse writes it) with one space per indentation level and a space
    between two tokens only where they would otherwise read as others."""
    out = []
    for depth, tokens in _logical_lines(text):
        parts = [tokens[0][0]]
        for (before, is_number), (after, _) in zip(tokens, tokens[1:]):
            parts.append(" " + after if _needs_space(before, after, is_number) else after)
        out.append(" " * depth + "".join(parts))
    compact = "\n".join(out) + "\n" if out else ""
    if ast.dump(ast.parse(compact, where)) != ast.dump(ast.parse(text, where)):
        raise ValueError(f"{where}: its compact text does not parse back to the same program")
    return compact
