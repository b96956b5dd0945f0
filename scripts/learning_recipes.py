"""What a reference recipe does on the embedded default, against the job's own defaults: the same job,
data and seeds, in-process (`runner/inprocess.py`, as the learning tests run the jobs), each run's
evaluations kept to see how fast it learns.

    python scripts/learning_recipes.py mult [--seeds 0,1,2] [--out runs.jsonl]      # mult-reference
    python scripts/learning_recipes.py finetune [--seeds 0,1,2] [--out runs.jsonl]  # lxmert-vqa, from one pretraining
    python scripts/learning_recipes.py pretrain [--seeds 0,1,2] [--out runs.jsonl]  # lxmert-pretrain
    python scripts/learning_recipes.py pretrain --store scale [--scale-images 1000]  # on the scale rehearsal's store

One JSON line per run (job, recipe, seed, wall seconds, steps, batch, final metrics, every evaluation),
then a table: each metric's mean ± sd per arm, the paired t-test's p over the seeds, and the samples
each arm took to reach 95 % of the default's mean best evaluation (`REACH`). The fine-tuning runs start
from one pretraining of the embedded default (its defaults, seed 0), the same for every run.

`--store scale` trains the pretraining job on the scale rehearsal's store instead (`jobs/benchmark.py scale`,
`xmodal_bench/scale.py`): reference-format TSV and JSON written by its own writer (`--quick`'s 10 boxes x 64
features) and ingested as `jobs/ingest.py lxmert` ingests them. Its features, labels, sentences and answers
are drawn at random, each apart: nothing in it can be learned beyond the train images themselves, so its
evaluations measure what a recipe does with no signal (they should stay at chance) and its speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from xmodal.base.commands import user_errors
from xmodal.base.errors import UserError
from xmodal.base.outputs import Output
from xmodal.config.experiment import load_config
from xmodal.report.stats import mean_std, paired_test
from xmodal.runner.inprocess import run_in_process

RECIPE = {"mult": "mult-reference", "finetune": "lxmert-vqa", "pretrain": "lxmert-pretrain"}
# job -> (the metrics of the table, the one whose speed of learning is measured: it must rise)
METRICS = {
    "mult": (["test/acc2", "test/mae", "test/corr", "best_valid/mae"], "valid/acc2"),
    "finetune": (["best_valid/accuracy", "best_valid/loss"], "valid/accuracy"),
    "pretrain": (["eval/match_acc", "eval/qa_acc", "eval/mlm_acc", "eval/obj_acc", "eval/attr_acc"], "eval/match_acc"),
}
EVAL_EVERY = {"mult": 50, "finetune": 25, "pretrain": 250}  # both arms: evaluations do not change training
REACH = 0.95
SCALE_BOXES, SCALE_FEATURES = 10, 64  # the scale rehearsal's --quick inputs


def mult_runs(seed: int, tmp: Path, recipe: str | None) -> tuple:
    from xmodal.data.mult.synthetic import build_synthetic_store
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.mult_job import MultJob

    cfg = load_config(MultTrainConfig, overrides=_overrides("mult", seed, recipe))
    store = _once(tmp / "mult", lambda path: build_synthetic_store(path, cfg.data.synthetic))
    return MultJob(), cfg, store


def pretrain_runs(seed: int, tmp: Path, recipe: str | None, scale_images: int | None = None) -> tuple:
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.pretrain_job import PretrainJob

    overrides = _overrides("pretrain", seed, recipe)
    if scale_images is None:
        cfg = load_config(PretrainConfig, overrides=overrides)
        store = _once(tmp / "lxmert", lambda path: build_synthetic_store(path, cfg.data.synthetic))
    else:
        store = _once(tmp / "scale", lambda path: scale_store(path, scale_images))
        cfg = load_config(PretrainConfig, overrides=[*overrides, f"data.store={store.path}"])
    return PretrainJob(), cfg, store


def scale_store(path: Path, images: int):
    """The scale rehearsal's store at `images` images (module docstring), its inputs removed."""
    from xmodal.data.lxmert.ingest import ingest_lxmert
    from xmodal_bench.scale import write_lxmert_inputs

    inputs = path.with_name(path.name + "-inputs")
    wrote = write_lxmert_inputs(str(inputs), images, num_objects=SCALE_BOXES, feat_dim=SCALE_FEATURES)
    store = ingest_lxmert(path, [wrote["tsv"]], [wrote["json"]], vocab=wrote["vocab"], num_objects=SCALE_BOXES,
                          split="hash", progress=False)
    for f in ("tsv", "json", "vocab"):
        Path(wrote[f]).unlink()
    inputs.rmdir()
    return store


def finetune_runs(seed: int, tmp: Path, recipe: str | None) -> tuple:
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_init import Init
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.jobs.pretrain_job import with_store_dims

    _, pcfg, store = pretrain_runs(0, tmp, None)
    if not (tmp / "pretrained" / "model.pt").exists():  # one pretraining (defaults, seed 0) for every run
        w, _ = run_in_process(*pretrain_runs(0, tmp, None))
        (tmp / "pretrained").mkdir()
        torch.save(w.model.state_dict(), tmp / "pretrained" / "model.pt")
    cfg = load_config(FinetuneConfig, overrides=_overrides("finetune", seed, recipe))
    data = _once(tmp / "vqa", lambda path: build_synthetic_vqa(
        store.path, path, questions_per_image=cfg.data.synthetic_questions_per_image))
    init = Init("checkpoint", path=str(tmp / "pretrained"), pretrain_answers=list(store.answers().answers))
    arch = with_store_dims(pcfg, store).model

    class FromPretrained(FinetuneJob):
        def resolve_start(self, cfg, data, uri, download_dir):
            return init, arch

    return FromPretrained(), cfg, data


RUNS = {"mult": mult_runs, "finetune": finetune_runs, "pretrain": pretrain_runs}
_OPENED: dict[Path, object] = {}


def _once(path: Path, build):
    if path not in _OPENED:
        _OPENED[path] = build(path)
    return _OPENED[path]


def _overrides(job: str, seed: int, recipe: str | None) -> list[str]:
    return [f"train.seed={seed}", f"train.eval_every={EVAL_EVERY[job]}", *([f"recipe={recipe}"] if recipe else [])]


def one_run(job: str, seed: int, recipe: str | None, tmp: Path, scale_images: int | None = None) -> dict:
    spec, cfg, data = RUNS[job](seed, tmp, recipe, scale_images) if scale_images else RUNS[job](seed, tmp, recipe)
    history: list = []
    t0 = time.perf_counter()
    _, final = run_in_process(spec, cfg, data, history)
    return {"job": job, "store": f"scale {scale_images}" if scale_images else "embedded", "recipe": recipe or "default",
            "seed": seed, "wall_s": round(time.perf_counter() - t0, 1),
            "steps": history[-1][0], "batch": cfg.train.batch_size, "final": final,
            "history": [[step, m] for step, m in history]}


def reached(row: dict, metric: str, target: float) -> int | None:
    """Samples trained when `metric` first reached `target` (None: never)."""
    return next((step * row["batch"] for step, m in row["history"] if m.get(metric, -1e9) >= target), None)


def table(job: str, rows: list[dict]) -> str:
    metrics, speed = METRICS[job]
    arms = {arm: sorted((r for r in rows if r["recipe"] == arm), key=lambda r: r["seed"]) for arm in
            ("default", RECIPE[job])}
    lines = [f"| metric | default | {RECIPE[job]} | paired t-test p |", "| --- | --- | --- | --- |"]
    for m in metrics:
        cells = []
        for arm in arms.values():
            mean, sd, _ = mean_std([r["final"].get(m) for r in arm])
            cells.append(f"{mean:.3f} ± {sd:.3f}")
        p = paired_test([r["final"][m] for r in arms[RECIPE[job]]], [r["final"][m] for r in arms["default"]])
        lines.append(f"| {m} | {cells[0]} | {cells[1]} | {'-' if p is None else f'{p:.3f}'} |")
    target = REACH * mean_std([max(m[speed] for _, m in r["history"]) for r in arms["default"]])[0]
    for label, key in (("samples to reach", None), ("steps", "steps"), ("wall s", "wall_s")):
        cells = []
        for arm in arms.values():
            values = [reached(r, speed, target) if key is None else r[key] for r in arm]
            cells.append(" / ".join("never" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:g}"
                                    for v in values))
        name = f"{label} {speed} >= {target:.3f}" if key is None else label
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", choices=sorted(RUNS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", choices=("embedded", "scale"), default="embedded",
                   help="pretrain only: the embedded default's store, or the scale rehearsal's (module docstring)")
    p.add_argument("--scale-images", type=int, default=1000, help="--store scale: its images (default 1000)")
    p.add_argument("--out", help="also write the JSON lines to this file (a new file), at the end")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE")
    a = p.parse_args(argv)

    def go() -> None:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip().isdigit()]
        if not seeds or len(seeds) != len(a.seeds.split(",")):
            raise UserError(f"--seeds {a.seeds!r}: expected whole numbers >= 0, comma-separated")
        if a.store == "scale" and a.job != "pretrain":
            raise UserError(f"--store scale: the scale rehearsal's store is a pretraining store; expected job "
                            f"pretrain, got {a.job}")
        if a.scale_images < 100:
            raise UserError(f"--scale-images {a.scale_images}: expected at least 100 (minival takes a share)")
        scale_images = a.scale_images if a.store == "scale" else None
        out = Output(a.out, "--out", "learning_recipes", file=True, overwrite=a.overwrite) if a.out else None
        torch.set_num_threads(a.threads)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for seed in seeds:
                for recipe in (None, RECIPE[a.job]):
                    rows.append(one_run(a.job, seed, recipe, Path(tmp), scale_images))
                    print(json.dumps(rows[-1]), flush=True)
        if out is not None:
            with out.stage() as stage:
                stage.tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
                stage.publish()
        print(table(a.job, rows))

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main())
