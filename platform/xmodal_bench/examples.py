"""The cost of a fine-tuning run's example pages against the run's own evaluation time.

    python jobs/benchmark.py examples --run-id RUN [--tracking-uri URI] [--examples 16 48] [--repeats 5]
        [--threads N] [--out bench-results]

On a finished fine-tuning run: the median over `--repeats` (interleaved) of (a) one prediction pass over the
pages' split as the run's evaluations make it (the job's streaming reader, its micro batch, the objective's
forward with predictions), times the passes the run made over that split (its logged evaluations, the
held-out pass with the selected model, one per robustness condition), and (b) for each count of
`--examples` (default 16, the default `examples.count`, and 48), the pages for that many examples: the
model on them with the attention hook (`predict`), then the pictures drawn and encoded and the HTML
written (`draw`): what `examples.log_run_examples` does before it logs. A row per count gives the pages'
seconds and their share of the evaluation. The run's own `time/end_of_run_s` (its pages and their
logging, in the run) is reported beside them.

Each figure is given in seconds and in CPU seconds of the process (all its threads). On a machine others
load, torch's threads wait for each other's cores and the evaluation's seconds grow tens of times more
than the pages': the CPU seconds with `--threads 1` (no thread waits for another) compare the two parts'
work whatever the load; the seconds are the figure on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", required=True, help="a finished fine-tuning run")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--split", default="valid", help="the pages' split (default valid)")
    p.add_argument("--examples", type=int, nargs="+", default=[16, 48],
                   help="examples on the pages, one row per count (default 16 48)")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure; the median is reported (default 5)")
    p.add_argument("--threads", type=int, help="torch threads for both figures (default: torch's own)")
    p.add_argument("--out", default="bench-results", help="folder for examples.json and examples.md")
    p.add_argument("--work", help="scratch folder (default: the temporary folder)")


def checked(args: argparse.Namespace):
    """Every input checked before anything is made: the counts and numbers, the output and scratch folders
    (creatable and writable), the run (a finished fine-tuning run), its set and split. Returns the run
    resolved, its kind and its set."""
    from xmodal import tracking
    from xmodal.examples.kinds import KINDS, resolve
    from xmodal.examples.run import ExamplesError, check_count
    from xmodal_bench import at_least, folder_arg

    for n in args.examples:
        check_count(n)
    at_least(args, 1, "repeats", "threads")
    folder_arg("--out", args.out)
    folder_arg("--work", args.work)  # (the scratch under it is made by `begin`, after these checks)
    r = resolve(tracking.resolve_tracking_uri(args.tracking_uri, "--tracking-uri"), args.run_id, "--run-id")
    if r.kind != "finetune":
        raise ExamplesError(f"--run-id: run {r.run_id!r} is {KINDS[r.kind].what}; this benchmark measures a "
                            "fine-tuning run's pages against its evaluation: expected a fine-tuning run")
    kind = KINDS[r.kind]
    data = kind.open(r)
    kind.check(r, data, args.split)
    return r, kind, data


def run(args: argparse.Namespace) -> int:
    import torch

    from xmodal import tracking
    from xmodal.data.finetune.stream import iter_eval_batches, local_reader
    from xmodal.examples.build import write_rendered
    from xmodal.examples.kinds import run_task
    from xmodal.examples.run import Shown
    from xmodal.export.source import from_run
    from xmodal.objectives.finetune import FinetuneObjective
    from xmodal_bench import begin, write_results

    r, kind, data = checked(args)
    uri, task = r.uri, run_task(r.run)
    counts = list(dict.fromkeys(args.examples))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    work, stamp, meta = begin(args, "examples")  # the scratch: removed when the command ends
    started = time.monotonic()
    source = from_run(uri, args.run_id, work / "model")
    cfg = source.config or {}
    batch = int(cfg.get("train", {}).get("batch_size", 32)) // int(cfg.get("scale", {}).get("num_workers", 1))
    model = source.model
    objective = FinetuneObjective(model, task).eval()
    logged = len(tracking.metric_history(uri, args.run_id, f"{args.split}/accuracy"))
    robust = len(cfg.get("robust", {}).get("conditions", [])) if args.split == "valid" else 0
    passes = logged + 1 + robust

    def one_pass() -> tuple[float, float]:
        t, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for b in iter_eval_batches(data, args.split, batch, reader=local_reader()):
                objective(b, with_predictions=True)
        return time.perf_counter() - t, time.process_time() - cpu

    def pages(n: int) -> tuple[float, float, float]:
        t, cpu = time.perf_counter(), time.process_time()
        notes: list[str] = []
        ex, size = kind.collect(model, data, args.split, n, notes, config=cfg)
        predicted = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=work) as d:
            shown = Shown(args.run_id, r.name, "finetune", task, args.split, str(data.path), ex, size, notes)
            write_rendered(kind.render(shown), Path(d))
            drawn = time.perf_counter()
        return predicted - t, drawn - predicted, time.process_time() - cpu

    one_pass(), [pages(n) for n in counts]  # warm: the first reads fill the page cache, the tokenizer, the index
    # interleaved, so that every figure sees the same load of a shared machine
    timed = [(one_pass(), [pages(n) for n in counts]) for _ in range(args.repeats)]
    eval_s = statistics.median(t[0][0] for t in timed)
    eval_cpu = statistics.median(t[0][1] for t in timed)
    by_count = {}
    for k, n in enumerate(counts):
        parts = [t[1][k] for t in timed]
        by_count[n] = {"pages_s": statistics.median(p + d for p, d, _ in parts),
                       "predict_s": statistics.median(p for p, _, _ in parts),
                       "draw_s": statistics.median(d for _, d, _ in parts),
                       "pages_cpu_s": statistics.median(c for _, _, c in parts)}
    total, total_cpu = eval_s * passes, eval_cpu * passes
    for v in by_count.values():
        v["pages_share"] = v["pages_s"] / total
        v["pages_cpu_share"] = v["pages_cpu_s"] / total_cpu
    res = {"meta": {**meta, "wall_s": time.monotonic() - started, "run_id": args.run_id, "task": task,
                    "split": args.split, "split_examples": len(data.split(args.split)), "batch": batch,
                    "threads": torch.get_num_threads(), "repeats": args.repeats},
           "eval_pass_s": eval_s, "passes": passes, "evaluation_s": total, "eval_pass_cpu_s": eval_cpu,
           "evaluation_cpu_s": total_cpu,
           "pages": [{"examples": n, **v} for n, v in by_count.items()],
           "run_end_of_run_s": r.run.metrics.get("time/end_of_run_s")}
    write_results(args.out, f"examples-{stamp}", res, table(res, args))
    return 0


def table(res: dict, args: argparse.Namespace) -> str:
    """The results as a Markdown table: the evaluation, then a row per count of examples."""
    m, end = res["meta"], res["run_end_of_run_s"]
    return "\n".join([
        f"| {m['task']} {args.split} ({m['split_examples']} examples, batch {m['batch']}, {m['threads']} torch "
        f"threads), median of {args.repeats} | seconds | of the evaluation | CPU seconds | of its CPU |",
        "| --- | --- | --- | --- | --- |",
        f"| one evaluation pass | {res['eval_pass_s']:.3f} | | {res['eval_pass_cpu_s']:.3f} | |",
        f"| the run's evaluation: {res['passes']} passes | {res['evaluation_s']:.3f} | 100 % | "
        f"{res['evaluation_cpu_s']:.3f} | 100 % |",
        *(f"| pages for {v['examples']} examples (predict {v['predict_s']:.3f}, draw {v['draw_s']:.3f}) | "
          f"{v['pages_s']:.3f} | {100 * v['pages_share']:.1f} % | {v['pages_cpu_s']:.3f} | "
          f"{100 * v['pages_cpu_share']:.1f} % |" for v in res["pages"]),
        f"| the run's own time/end_of_run_s (its pages and their logging) | "
        f"{f'{end:.3f}' if end is not None else '-'} | | | |",
    ])
