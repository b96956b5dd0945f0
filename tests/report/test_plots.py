"""A report's plots: written as PNGs and logged to the sweep's parent run."""

from __future__ import annotations

from xmodal import tracking
from xmodal.report import make_report


def test_plots_exist_and_are_logged_to_the_parent(store, tmp_path):
    uri, _, parent = store
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out")
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert "| 4 | False | - | 1 | 0.9500 |" in rep.markdown
    assert rep.out_dir == (tmp_path / "out").resolve() and rep.files[:2] == (rep.out_dir / "table.md",
                                                                              rep.out_dir / "table.csv")
    assert sorted(p.name for p in rep.files[2:]) == pngs and all(p.parent == rep.out_dir for p in rep.files)
    assert pngs == ["eval_match_acc_vs_model.x_layers.png", "eval_match_acc_vs_tasks.feat_loss.png",
                    "eval_match_acc_vs_tasks.obj_feat.png", "learning_curves_eval_match_acc.png"]
    for p in pngs:
        assert (tmp_path / "out" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = set(tracking.list_artifacts(uri, parent, "report"))
    assert {"report/table.md", "report/table.csv", "report/learning_curves_eval_match_acc.png"} <= logged
