"""Our recipes against the reference codes' own training loops, step for step.

For LXMERT VQA fine-tuning and pretraining (airsplay/lxmert) and for MulT (yaohungt/Multimodal-
Transformer), the reference's own training code runs unchanged from the checkout given (its optimizer
file, its task's loop: forward, loss, backward, clip, step), and after each of its optimizer steps our
job's pieces take theirs under the recipe (`recipe=lxmert-vqa`, `lxmert-pretrain`, `mult-reference`:
the job's config -> its `build_objective` -> `core.runtime.prepare` -> `core.step.train_step`), on the
same initial weights and the same batches in the same order, dropout off. In float32 a third model
runs too: ours driven by the reference's optimizer and loop body, the floor that float32 alone sets.

Each step prints both losses, both learning rates, the largest relative parameter difference (and the
floor's). Targets: float64, the relative loss and parameter differences below 1e-9 at every step;
float32, within ten times the floor (LXMERT: the loss also below 1e-6 relative); MulT must see a
plateau drop, and ours the same one. Exit 0 when every training meets them, 1 when one does not, 2 on
bad input. What is supplied to the reference (its command line, its data, "bert-base-uncased", the
torch of today): recipes_lxmert.py and recipes_mult.py.

    python scripts/reference/recipes.py --lxmert LXMERT_CHECKOUT --mult MULT_CHECKOUT
        [--trainings vqa,pretrain,mult] [--dtypes float64,float32] [--steps 60] [--out RESULT.json]

A checkout is a folder of the repository's files (e.g. `git clone https://github.com/airsplay/lxmert`);
only the one a chosen training needs is required. `--out` (JSON: every row and verdict) must not exist.
Each training and dtype runs in its own process (the references set global state: their command line,
torch's default dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAININGS = ("vqa", "pretrain", "mult")
DTYPES = ("float64", "float32")
# The files each training runs from its checkout (what the checkout must hold).
NEEDS = {
    "vqa": ("lxmert", ("src/lxrt/optimization.py", "src/lxrt/modeling.py", "src/lxrt/entry.py", "src/tasks/vqa.py",
                       "src/tasks/vqa_model.py", "src/param.py")),
    "pretrain": ("lxmert", ("src/lxrt/optimization.py", "src/lxrt/modeling.py", "src/pretrain/lxmert_pretrain.py",
                            "src/pretrain/lxmert_data.py", "src/param.py")),
    "mult": ("mult", ("main.py", "src/train.py", "src/models.py", "modules/transformer.py")),
}
MIN_STEPS = 50


class BadInput(Exception):
    pass


def choices(text: str, valid: tuple[str, ...], flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if not items or bad or len(set(items)) < len(items):
        raise BadInput(f"{flag} {text!r}: expected distinct names from {', '.join(valid)}, comma-separated")
    return items


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """Every argument checked before anything runs; BadInput names the flag, the value and what it needs."""
    args.trainings = choices(args.trainings, TRAININGS, "--trainings")
    args.dtypes = choices(args.dtypes, DTYPES, "--dtypes")
    if args.steps < MIN_STEPS:
        raise BadInput(f"--steps {args.steps}: expected at least {MIN_STEPS} (the check spans the warm-up and the "
                       "decay over that many steps)")
    if args.mult_patience < 0:
        raise BadInput(f"--mult-patience {args.mult_patience}: expected an integer >= 0")
    for training in args.trainings:
        which, files = NEEDS[training]
        path = getattr(args, which)
        if path is None:
            raise BadInput(f"--{which}: required for --trainings {training} (a checkout of "
                           f"{'airsplay/lxmert' if which == 'lxmert' else 'yaohungt/Multimodal-Transformer'})")
        folder = Path(path)
        if not folder.is_dir():
            raise BadInput(f"--{which} {path!r}: {'is not a folder' if folder.exists() else 'does not exist'}; "
                           "expected a checkout of the reference")
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise BadInput(f"--{which} {path!r}: not a checkout of the reference ({', '.join(missing)} missing)")
        setattr(args, which, folder.resolve())
    if args.out is not None and not args.worker:  # the output policy: a new file, published whole at the end
        from xmodal.base.errors import UserError
        from xmodal.base.outputs import Output

        try:
            args.out = Output(args.out, "--out", "reference recipes", file=True, overwrite=None)
        except UserError as e:
            raise BadInput(str(e)) from None
    return args


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line (argparse prints its usage too)
        raise BadInput(message)


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lxmert", help="checkout of airsplay/lxmert (for vqa, pretrain)")
    p.add_argument("--mult", help="checkout of yaohungt/Multimodal-Transformer (for mult)")
    p.add_argument("--trainings", default=",".join(TRAININGS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=60, help=f"optimizer steps of each training (>= {MIN_STEPS})")
    p.add_argument("--mult-patience", type=int, default=0, help="MulT's --when: epochs without a better "
                   "validation loss before the plateau drops (the reference's default 20 would not drop here)")
    p.add_argument("--out", help="write every row and verdict here as JSON (a new file)")
    p.add_argument("--worker", nargs=3, metavar=("TRAINING", "DTYPE", "RESULT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_worker(args: argparse.Namespace) -> int:
    """One training in one dtype, in this process: its rows printed as they come, then written."""
    import torch
    from recipes_compare import HEADER, line, verdict

    training, dtype_name, result = args.worker
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(1)  # the same arithmetic whatever the machine's cores (and less contention)
    torch.manual_seed(0)
    print(f"\n{training} {dtype_name}\n{HEADER}", flush=True)

    def emit(row) -> None:
        print(line(row), flush=True)

    if training == "mult":
        from recipes_mult import run_mult

        per_epoch = 8
        rows = run_mult(args.mult, dtype, epochs=-(-args.steps // per_epoch), steps=per_epoch, layers=1,
                        patience=args.mult_patience, emit=emit)
    else:
        from recipes_lxmert import run_pretrain, run_vqa

        run = run_vqa if training == "vqa" else run_pretrain
        rows = run(args.lxmert, dtype, epochs=2, steps=-(-args.steps // 2), layers=(2, 1, 1), emit=emit)
    v = verdict(training, dtype_name, rows, MIN_STEPS, lambda r: extra(training, r))
    Path(result).write_text(json.dumps({"rows": [vars(r) for r in rows], "verdict": v.as_dict()}))
    return 0


def extra(training: str, rows) -> list[str]:
    """Each training's own requirements: the same rate at every step; MulT: a plateau drop."""
    from recipes_compare import rel

    out = []
    worst = max((rel(r.our_lr, r.ref_lr) for r in rows), default=0.0)
    if worst > 1e-12:
        out.append(f"learning rate: ours differs from the reference's by {worst:.2e} (relative)")
    if training == "mult" and not any("plateau" in r.note for r in rows[:-1]):
        out.append("no plateau drop before the last epoch's end (none to train after): raise --steps or lower "
                   "--mult-patience")
    return out


def main(argv: list[str]) -> int:
    try:
        args = checked(parse(argv))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        sys.path.insert(0, str(HERE))
        return run_worker(args)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="recipes-") as tmp:
        for training in args.trainings:
            for dtype in args.dtypes:
                result = Path(tmp) / f"{training}-{dtype}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", training, dtype, str(result)]
                done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}"
                                                f"{os.environ.get('PYTHONPATH', '')}"})
                if done.returncode != 0 or not result.exists():
                    verdicts.append({"training": training, "dtype": dtype, "passed": False,
                                     "notes": [f"the run failed (exit {done.returncode})"]})
                    continue
                verdicts.append(json.loads(result.read_text()))
        report(verdicts)
    if args.out is not None:
        with args.out.stage() as stage:
            stage.tmp.write_text(json.dumps(verdicts, indent=1))
            stage.publish()
    return 0 if all(v.get("verdict", v).get("passed") for v in verdicts) else 1


def report(results: list[dict]) -> None:
    print("\ntraining  dtype    steps  max loss diff  max param diff  floor loss  floor params  result")
    for r in results:
        v = r.get("verdict", r)
        if "max_loss" not in v:
            print(f"{v['training']:9} {v['dtype']:8} failed: {'; '.join(v['notes'])}")
            continue
        floor = (f"{v['floor_loss']:10.2e}  {v['floor_params']:12.2e}" if v["floor_loss"] is not None
                 else f"{'-':>10}  {'-':>12}")
        verdict_text = ("meets its targets" + "".join(f"; {n}" for n in v["notes"]) if v["passed"]
                        else "MISSES: " + "; ".join(v["notes"]))
        print(f"{v['training']:9} {v['dtype']:8} {v['steps']:5d}  {v['max_loss']:13.2e}  {v['max_params']:14.2e}  "
              f"{floor}  {verdict_text}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
