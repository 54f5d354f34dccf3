"""`loopformer demo --quick`: the whole pipeline (sweep of a standard Transformer and looped models with and
without timestep encoding, table, plots) in small; and the demo's grid has the layout of Table 2."""

from __future__ import annotations

import pytest

from loopformer.cli import main
from loopformer.experiments.demo import DEMO_BASELINE, DEMO_GRID
from loopformer.experiments.report import find_runs


def test_demo_grid_covers_the_table():
    keys = dict(DEMO_GRID)
    assert keys["model.timestep"] == ["false", "true"] and len(keys["model.loops"]) >= 3
    assert [int(r) for r in keys["model.loops"]] == sorted(int(r) for r in keys["model.loops"])
    assert "model.loops=1" in DEMO_BASELINE and any(b.startswith("model.n_layers=") for b in DEMO_BASELINE)


@pytest.mark.slow
def test_quick_demo(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| Task | Standard L=2 | Looped r=2 | r=3 | w/ Timestep r=2 | r=3 |" in printed
    runs = find_runs(out)
    assert sorted((r["variant"], r["loops"]) for r in runs) == [("looped", 2), ("looped", 3), ("standard", 1),
                                                               ("tmlt", 2), ("tmlt", 3)]
    for f in ("table.md", "table.csv", "loops.png", "loopwise.png", "demo.yaml"):
        assert (out / f).is_file()
    # running it again finds everything finished and only rebuilds the report
    assert main(["demo", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    assert len(find_runs(out)) == 5
