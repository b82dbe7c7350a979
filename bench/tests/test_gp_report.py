"""The GP accuracy reports (bench.np.gp_report): a run stopped before the end of its schedule
is shown as such, and the paper protocol publishes under its own name."""
import json

import torch

from bench.np import gp_report as gp_quick
from bench.np.train_history import LogPoint, append_history, start_history


def _write_eval(run_dir, model, kernel, steps, schedule, ll):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"eval_{kernel}.json").write_text(json.dumps({
        "model": model, "kernel": kernel, "num_batches": 3000, "train_steps": steps, "schedule_steps": schedule,
        "train_seconds": 600.0, "log_likelihood_mean": ll, "log_likelihood_std": 0.5}))


def test_paper_protocol_marks_unfinished_runs(tmp_path):
    runs = tmp_path / "runs"
    for kernel, ll in (("rbf", 1.31), ("matern52", 0.9)):
        _write_eval(runs / "tnpd", "tnpd", kernel, 100_000, 100_000, ll)
        _write_eval(runs / "cmanp", "cmanp", kernel, 8_000, 100_000, ll - 1)
    out = tmp_path / "results"
    assert gp_quick.main([str(runs), str(out), "--protocol", "paper"]) == 0
    text = (out / "gp_full.md").read_text()
    assert "**paper protocol**" in text and "not run" not in text
    assert "| tnpd | 100,000 |" in text
    assert "| cmanp | 8,000 / 100,000 |" in text
    assert "0.310 ± 0.500" in text  # cmanp RBF
    assert json.loads((out / "gp_full.json").read_text())["protocol"] == "paper"
    assert not (out / "gp_quick.md").exists()


def test_quick_protocol_keeps_its_name_and_reads_old_results(tmp_path):
    runs = tmp_path / "runs"
    _write_eval(runs / "lbanp", "lbanp", "rbf", 5000, 5000, 0.4)
    # Results written before schedule_steps existed count as finished runs.
    old = json.loads((runs / "lbanp" / "eval_rbf.json").read_text())
    del old["schedule_steps"]
    (runs / "lbanp" / "eval_rbf.json").write_text(json.dumps(old))
    out = tmp_path / "results"
    assert gp_quick.main([str(runs), str(out)]) == 0
    text = (out / "gp_quick.md").read_text()
    assert "**quick protocol**" in text and "| lbanp | 5,000 |" in text
    assert "bench/np/gp_quick.sh 5000 3000" in text


def test_variants_of_a_model_get_a_row_each_named_by_their_options(tmp_path):
    runs = tmp_path / "runs"
    _write_eval(runs / "retreever", "retreever", "rbf", 100_000, 100_000, 1.1)
    _write_eval(runs / "retreever-transformer", "retreever", "rbf", 100_000, 100_000, 1.2)
    variant = runs / "retreever-transformer" / "eval_rbf.json"
    variant.write_text(json.dumps({**json.loads(variant.read_text()),
                                   "model_options": {"aggregator": "transformer", "backprop_through_tree": False}}))
    _write_eval(runs / "tnpd", "tnpd", "rbf", 100_000, 100_000, 1.3)
    out = tmp_path / "results"
    assert gp_quick.main([str(runs), str(out), "--protocol", "paper"]) == 0
    rows = [line for line in (out / "gp_full.md").read_text().splitlines() if line.startswith("| ")][2:]
    # The run without stored options predates them: it was trained with the then-default mean aggregator.
    assert [row.split(" | ")[0] for row in rows] == [
        "| tnpd", "| retreever (aggregator=mean, backprop_through_tree=True)", "| retreever"]
    assert "1.200 ± 0.500" in rows[2] and "1.25 / 0.81 (TCA Table 13)" in rows[2]
    assert set(json.loads((out / "gp_full.json").read_text())["runs"]) == {"tnpd", "retreever", "retreever-transformer"}


def test_training_curves_cover_every_run_with_a_history(tmp_path):
    runs = tmp_path / "runs"
    _write_eval(runs / "tnpd", "tnpd", "rbf", 100_000, 100_000, 1.3)
    # A run still training: no evaluation yet, its model is read from the checkpoint.
    (runs / "lbanp").mkdir()
    torch.save({"model": "lbanp", "model_options": {}}, runs / "lbanp" / "checkpoint.pt")
    for run, losses in (("tnpd", (0.5, -0.4, -1.2)), ("lbanp", (0.6, 0.1))):
        start_history(runs / run, 0)
        for i, loss in enumerate(losses):
            append_history(runs / run, LogPoint(250 * (i + 1), loss, 5e-4, 3.0))
    out = tmp_path / "results"
    assert gp_quick.main([str(runs), str(out), "--protocol", "paper"]) == 0
    curves = json.loads((out / "gp_full.json").read_text())["curves"]
    assert curves["tnpd"]["loss"] == [0.5, -0.4, -1.2] and curves["tnpd"]["target"] == 1.39
    assert curves["lbanp"]["steps"] == [250, 500] and curves["lbanp"]["label"] == "lbanp"
    assert curves["lbanp"]["target"] == 1.27
    assert (out / "gp_full.png").stat().st_size > 0
    assert "Training curves (`gp_full.png`, written with this table)" in (out / "gp_full.md").read_text()


def test_no_history_no_curves(tmp_path):
    runs = tmp_path / "runs"
    _write_eval(runs / "tnpd", "tnpd", "rbf", 5000, 5000, 1.0)
    out = tmp_path / "results"
    assert gp_quick.main([str(runs), str(out)]) == 0
    assert not (out / "gp_quick.png").exists() and "Training curves" not in (out / "gp_quick.md").read_text()
