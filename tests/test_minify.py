"""training.minify: what a packed record's modules lose (docstrings, comments, the annotations of undecorated
functions, spaces) and what they keep (the program: the same results, Triton kernels and torch.library operators
included)."""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import REPO
from training.minify import _needs_space, compact_source, minify_source, strip_source
from training.packing import generate_script, shipped_modules


def minified_module(name: str, monkeypatch) -> types.ModuleType:
    """The repository module `name`, minified, as a module of its own beside the original (registered, as
    dataclasses need their module in sys.modules)."""
    path = REPO.joinpath(*name.split(".")).with_suffix(".py")
    module = types.ModuleType(f"minified_{name.replace('.', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(minify_source(path.read_text(), str(path)), str(path), "exec"), module.__dict__)
    return module


def test_docstrings_comments_and_function_annotations_go():
    source = '''"""Module doc."""
from __future__ import annotations
import dataclasses


@dataclasses.dataclass
class Config:
    """Class doc."""
    width: int = 3  # a field: its annotation is the dataclass's


def f(x: int, *rest: str, flag: bool = False, **more: float) -> int:
    """Function doc."""
    # a comment
    return x + 1


def only_doc():
    """Nothing else."""


@triton.jit
def kernel(X, BLOCK: tl.constexpr):
    pass


@triton_op("ns::op", mutates_args=())
def op(x: torch.Tensor) -> torch.Tensor:
    return x


@triton.autotune(configs=[])
@triton.jit(do_not_specialize=["n"])
def tuned(n, BLOCK: tl.constexpr):
    "A string statement later in a body is kept."
    x = 1
    "this one"
'''
    out = strip_source(source)
    assert all(doc not in out for doc in ("Module doc", "Class doc", "Function doc", "Nothing else", "comment",
                                          "A string statement later"))
    assert "def f(x, *rest, flag=False, **more):" in out and "width: int = 3" in out
    assert "def op(x: torch.Tensor) -> torch.Tensor:" in out  # triton_op reads its schema from them
    assert "def kernel(X, BLOCK: tl.constexpr):" in out and "def tuned(n, BLOCK: tl.constexpr):" in out
    assert "'this one'" in out and "def only_doc():\n    pass" in out
    assert out.startswith("from __future__ import annotations\n")  # still first: the docstring was before it
    assert strip_source(out) == out and strip_source("") == "" and strip_source('"""only a docstring"""\n') == ""
    with pytest.raises(SyntaxError):
        strip_source("def broken(:\n", "broken.py")


def test_compact_layout_keeps_a_space_only_where_the_tokens_need_it():
    source = ("x = 1 if a else 2.0\ny = f'{a!r:>10} b' + b'x' * -3 ** 2\nz = a[...] if not a . b else (1).real\n"
              "def f(*args, **kw) -> int:\n    if x:\n        return 'a' in kw\n    return x . __class__\n"
              "w = 1 .real + 0x1f - 1e-05\n")
    out = compact_source(strip_source(source))
    assert out == ("x=1 if a else 2.0\ny=f'{a!r:>10} b'+b'x'*-3**2\nz=a[...]if not a.b else 1 .real\n"
                   "def f(*args,**kw):\n if x:\n  return'a'in kw\n return x.__class__\nw=1 .real+31-1e-05\n")
    assert compact_source(out) == out and compact_source("") == ""
    assert _needs_space("*", "*", False) and _needs_space(".", ".", False) and _needs_space("-", ">", False)
    assert _needs_space("1", "if", True) and _needs_space("else", "f'x'", False)
    assert not _needs_space(")", "if", False) and not _needs_space("=", "-", False)


def test_minifying_every_shipped_module_keeps_it_compilable_and_smaller():
    for name, (path, _) in shipped_modules(REPO).items():
        source = path.read_text()
        minified = minify_source(source, str(path))
        compile(minified, str(path), "exec")
        assert len(minified) <= len(strip_source(source, str(path))) <= len(source), name


def test_minified_modules_compute_what_the_originals_do(monkeypatch):
    from quant import knapsack, pack
    from training import schedule
    from training.config import OptimConfig
    small_pack, small_knapsack, small_schedule = (minified_module(n, monkeypatch) for n in ("quant.pack", "quant.knapsack",
                                                                                 "training.schedule"))
    rng = np.random.default_rng(0)
    codes = rng.integers(-15, 16, size=1000).astype(np.int8)
    for layout in ("byte", "dense", "bitplane"):
        data = pack.encode_codes(codes, 5, layout)
        assert small_pack.encode_codes(codes, 5, layout) == data
        assert np.array_equal(small_pack.decode_codes(data, 5, layout, codes.size), codes)
    options = {f"t{i}": [(float(rng.random()), float(rng.integers(1, 50))) for _ in range(4)] for i in range(12)}
    assert small_knapsack.solve(options, 200.0) == knapsack.solve(options, 200.0)
    cfg = OptimConfig(warmup_steps=10, warmdown_frac=0.4, lr_floor=0.05)
    for progress, step in ((0.0, 0), (0.3, 5), (0.7, 50), (0.99, 90), (1.2, 99)):
        assert small_schedule.lr_multiplier(progress, step, cfg) == schedule.lr_multiplier(progress, step, cfg)


KERNEL_CALL = """
import json, sys, torch
sys.path.insert(0, sys.argv[1]) if sys.argv[1] != "record" else None
if sys.argv[1] == "record":  # the record's own import hook serves its minified modules
    record = {"__name__": "record", "__file__": sys.argv[2]}
    exec(compile(open(sys.argv[2]).read(), sys.argv[2], "exec"), record)
    sys.meta_path.insert(0, record["EmbeddedModules"]())
from kernels import mlp
import kernels.mlp_triton as mlp_triton
assert mlp_triton.kernels_interpreted()
g = torch.Generator().manual_seed(0)
x, w_up, w_down = torch.randn(37, 40, generator=g), torch.randn(72, 40, generator=g), torch.randn(40, 72, generator=g)
assert mlp.kernels_used_for(x)
print(json.dumps([mlp.__file__, mlp.fused_mlp(x, w_up, w_down).flatten().tolist()]))
"""


def test_a_minified_triton_kernel_runs_as_the_original_does(tmp_path):
    """Triton reads a kernel's source (inspect.getsource, through the record's linecache entry): the minified
    kernel, served by the record's import hook, gives the repository kernel's output bit for bit (interpreter)."""
    script = tmp_path / "train_gpt.py"
    script.write_text(generate_script(REPO))
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TRITON_INTERPRET": "1"}
    outputs = []
    for where in (str(REPO), "record"):
        done = subprocess.run([sys.executable, "-c", KERNEL_CALL, where, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (repo_file, repo_y), (record_file, record_y) = outputs
    assert repo_file == str(REPO / "kernels/mlp.py") and record_file == str(tmp_path / "kernels/mlp.py")
    assert repo_y == record_y


def test_locals_get_short_names_and_everything_read_by_name_keeps_its_own():
    source = '''
import math
total = 0
def f(width, *, depth=2):
    result = width * depth
    for item in range(depth):
        result += item
    squares = [k * k for k in range(3)]
    outer = [total for unused in range(2)]
    try:
        math.sqrt(-1)
    except ValueError as error:
        result += len(str(error))
    import os.path
    def inner():
        return captured
    captured = result
    return result + sum(squares) + len(outer) + inner() + (lambda: width)() + int(bool(os.path))
def g():
    answer = 1
    return locals()
def h():
    hidden = 1
    def set_it():
        nonlocal hidden
        hidden = 2
    set_it()
    return hidden
'''
    namespace, renamed = {}, {}
    exec(source, namespace)
    out = minify_source(source)
    exec(out, renamed)
    assert renamed["f"](3, depth=4) == namespace["f"](3, depth=4) and renamed["h"]() == namespace["h"]() == 2
    assert renamed["g"]() == {"answer": 1}, "a function that reads its locals by name keeps them"
    for kept in ("width", "depth", "total", "captured", "inner", "os.path", "math", "hidden", "set_it"):
        assert kept in out, kept
    for renamed_away in ("result", "item", "squares", "error", "unused", " k "):
        assert renamed_away not in out, renamed_away
