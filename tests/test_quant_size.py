"""Size accounting: the code a run counts (the train_gpt.py a record of this tree ships, and a bound on its
config.toml) and the 16,000,000-byte cap."""
import os
import random
from pathlib import Path

import pytest

from quant.size import CAP_BYTES, check_total
from training import packing
from training.packing import generate_script, script_bytes, shipped_modules
from training.shipped_code import CONFIG_BYTES, code_bytes
from training.sources import collect_modules

REPO = Path(__file__).resolve().parents[1]


def test_a_run_counts_the_script_a_record_of_this_tree_ships_and_the_config_bound():
    script = generate_script(REPO).encode()
    assert code_bytes() == len(script) + CONFIG_BYTES == script_bytes(REPO) + CONFIG_BYTES
    assert generate_script(REPO).encode() == script, "the script is a function of the tree alone"


FRONT_END = "training.scoring_inputs"  # the scoring tools' input checks; the scoring itself is training.score's


def test_what_scores_an_artifact_ships_in_a_record():
    """A record scores its artifact with what it ships: everything scripts/evaluate.py imports, itself, the count
    of a checkout's code (which a record brings its own of) and the tools' input checks aside; those checks use
    nothing a record does not ship."""
    shipped = set(shipped_modules(REPO))
    needed = {name for name in collect_modules(REPO, "scripts.evaluate", stop=(packing.SEAM,))
              if not name.startswith("scripts")}
    assert FRONT_END in needed and FRONT_END not in shipped
    assert not sorted(needed - shipped - {FRONT_END}), \
        "imported to score an artifact, but not in a record's train_gpt.py"
    front_end = set(collect_modules(REPO, FRONT_END, stop=(packing.SEAM,))) - {FRONT_END}
    assert not sorted(front_end - shipped), "the input checks import what a record does not ship"
    assert not {"training.shipped_code", "training.packing", "training.minify", "training.sources"} & shipped


def test_the_count_is_made_again_when_a_source_changes_and_only_then(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import helper\nprint(helper.X)\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    made = []
    real = packing.generate_script
    monkeypatch.setattr(packing, "generate_script", lambda repo: made.append(repo) or real(repo))
    first = script_bytes(tmp_path)
    assert script_bytes(tmp_path) == first and len(made) == 1
    assert packing.made_script(tmp_path) == real(tmp_path) and len(made) == 1  # what a record ships, kept too
    (tmp_path / "helper.py").write_text("X = 'a longer value than before, which the script carries'\n")
    assert script_bytes(tmp_path) > first and len(made) == 2
    (tmp_path / "helper.py").write_text("X = 'a longer value than before, which the script carries'\n")
    os.utime(tmp_path / "helper.py", ns=(1, 1))  # touched: made again, to the same bytes
    assert script_bytes(tmp_path) == len(real(tmp_path).encode()) and len(made) == 3


def test_check_total_and_cap():
    ok = check_total(15_000_000, 999_999)
    assert ok == {"artifact_bytes": 15_000_000, "code_bytes": 999_999, "total_bytes": 15_999_999,
                  "cap": CAP_BYTES, "fits": True, "over_by": 0}
    assert check_total(15_000_000, 1_000_000)["fits"]  # exactly at the cap fits
    over = check_total(15_900_000, 100_123)
    assert not over["fits"] and over["over_by"] == 123
    assert check_total(10, 5, cap=12)["over_by"] == 3
    with pytest.raises(ValueError, match=">= 0"):
        check_total(-1, 0)


def test_record_bytes_prices_each_module_by_what_the_script_loses_without_it(tmp_path, monkeypatch, capsys):
    from scripts import record_bytes
    (tmp_path / "train.py").write_text("import helper\nimport big\nprint(helper.X, big.Y)\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    # random (seeded: the packed sizes of other draws differ by tens of bytes) and so incompressible: costs its size
    (tmp_path / "big.py").write_text("Y = " + repr(random.Random(0).randbytes(3000).hex()) + "\n")
    rows = {row["module"]: row for row in record_bytes.module_costs(tmp_path)}
    assert rows["all"]["cost"] == len(generate_script(tmp_path).encode())
    assert rows["big.py"]["cost"] > 3000  # random hex packs 2:1 at best
    # a compressor's output is not monotonic in its input: a few bytes' module can cost a few bytes either way
    assert abs(rows["helper.py"]["cost"]) < 60
    assert rows["big.py"]["minified"] == len((tmp_path / "big.py").read_text().replace(" = ", "="))
    sizes = record_bytes.compressors(tmp_path)
    n = sizes["brotli"]
    assert sizes["brotli base85"] == 5 * (n // 4) + (n % 4 + 1 if n % 4 else 0) and sizes["raw"] > 6000
    monkeypatch.setattr(record_bytes, "REPO", tmp_path)
    record_bytes.main()
    out = capsys.readouterr().out
    assert f"| big.py | {rows['big.py']['source']:,} | " in out and "| all | " in out and "| xz base85 |" in out
