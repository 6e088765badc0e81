"""A record's train_gpt.py: HEAD, whose one literal holds RUNTIME and the modules, packed (training.packing).

HEAD is all the file says in the clear: it unpacks the literal into PACKED (RUNTIME's source, then a path and a
source per module) and runs RUNTIME, which is the whole runtime of a record: an import hook that serves the embedded
sources, --unpack, and the record's own training.shipped_code (its code bytes: this file and its config; its digest:
that of the repository sources it was made from). Standard library and brotli only (the artifact codec, which a
record needs anyway): a record needs nothing of this repository.
"""

HEAD = '''#!/usr/bin/env python3
# A record of the mhcgolf repository: python train_gpt.py [--config config.toml] [section.key=value ...]
# python train_gpt.py --unpack DIR writes its sources out. Below: its runtime and sources, Brotli-compressed.
import base64,brotli
PACKED=brotli.decompress(base64.b85decode(b'@PAYLOAD@')).decode().split('\\0')
exec(compile(PACKED[0],'<runtime>','exec'))
'''

RUNTIME = '''import argparse
import importlib.abc
import importlib.machinery
import linecache
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
CODE_DIGEST = "@DIGEST@"  # training.sources.code_digest of the repository's sources this record was made from
MODULES = {}  # module name -> (is a package, the path under HERE, source)
for path, source in zip(PACKED[1::2], PACKED[2::2]):
    parts = path.removesuffix(".py").split("/")
    MODULES[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (parts[-1] == "__init__", path, source)


class EmbeddedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """File names are the repository's, under this folder: __file__-relative paths, tracebacks and
    inspect.getsource (Triton reads kernel sources) work as in the repository."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        is_package, relative, _ = MODULES[fullname]
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=str(HERE / relative), is_package=is_package)
        spec.has_location = True  # sets __file__
        return spec

    def get_source(self, fullname):
        return MODULES[fullname][2]

    def create_module(self, spec):
        return None  # a plain module object

    def exec_module(self, module):
        source, filename = self.get_source(module.__name__), module.__spec__.origin
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), module.__dict__)


def write_sources(out):
    """The embedded modules as files under `out`, refusing to write over any file (a checkout, say)."""
    paths = {out / relative: source for _, relative, source in MODULES.values()}
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise SystemExit(f"--unpack {out}: {len(existing)} of the {len(paths)} files exist already (e.g. "
                         f"{existing[0]}); nothing was written (hint: unpack into an empty folder)")
    for path, source in paths.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        part.write_text(source, encoding="utf-8")
        part.replace(path)
    print(f"wrote {len(MODULES)} modules under {out}")


def script_code_bytes(config):
    """The code this record ships: this one file and the config it runs with."""
    config = Path(config)
    return Path(__file__).stat().st_size + (config.stat().st_size if config.is_file() else 0)


def config_path(argv):
    """The --config a run is given (train.py parses it again, with the overrides)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default=str(HERE / "config.toml"))
    return p.parse_known_args(argv)[0].config


def shipped_code(config):
    """This record's training.shipped_code, which a checkout computes from its tree."""
    module = types.ModuleType("training.shipped_code")
    module.code_bytes = lambda: script_code_bytes(config)
    module.code_digest = lambda: CODE_DIGEST
    return module


def main(argv):
    if argv[:1] == ["--unpack"]:
        if len(argv) != 2:
            raise SystemExit("usage: python train_gpt.py --unpack DIR")
        return write_sources(Path(argv[1]))
    sys.meta_path.insert(0, EmbeddedModules())
    sys.modules["training.shipped_code"] = shipped_code(config_path(argv))
    import train
    return train.cli(argv, default_config=str(HERE / "config.toml"))  # bad input: one line, as train.py prints


if __name__ == "__main__":
    main(sys.argv[1:])
'''
