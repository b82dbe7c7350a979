"""`python -m bench run chapter_memory`: the chapter's 2-D memory grid, on a tiny slice."""
import json

from bench.np import chapter_memory


def test_grid_is_the_chapters_and_every_column_has_eight_figures():
    assert len(chapter_memory.GRID) == 8 and {nc for nc, _ in chapter_memory.GRID} == {10, 100, 1_000, 5_000}
    assert {nt for _, nt in chapter_memory.GRID} == {10, 1_000}
    from attn_ext.models import MODELS

    for column, (model, figures) in chapter_memory.CHAPTER_MB.items():
        assert model in MODELS and len(figures) == 8, column
    assert "tnpd_masked" in chapter_memory.all_models()


def test_two_cells_measured_in_2d_and_reported_beside_the_chapter(tmp_path):
    # One cell of TNP-D's [N, N] formulation over a 20 MB cap, one measured: the sweep goes on.
    code = chapter_memory.run_chapter_memory(["linear_tnp", "tnpd_masked"], ((10, 10), (5_000, 1_000)),
                                             out_dir=tmp_path, cap_mb=20.0, timeout=120.0)
    result = json.loads((tmp_path / "chapter_memory.json").read_text())
    cells = {(r["model"], r["N_c"]): r for r in result["rows"]}
    assert code == 0 and result["config"]["dim_x"] == 2
    assert cells[("linear_tnp", 10)]["peak_extra_mb"] is not None
    assert cells[("tnpd_masked", 5_000)]["status"] == "> cap"
    md = (tmp_path / "chapter_memory.md").read_text()
    assert "| 10 | 10 |" in md and "16 / " in md and result["weights_mb"]["linear_tnp"] > 0
    assert (tmp_path / "chapter_memory.png").exists()
