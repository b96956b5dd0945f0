"""The cost of a fine-tuning run's example pages against the run's own evaluation time.

    python jobs/benchmark.py examples --run-id RUN [--tracking-uri URI] [--examples 48] [--repeats 3]
        [--out bench-results]

On a finished fine-tuning run: the median over `--repeats` (interleaved) of (a) one prediction pass over the pages'
split as the run's evaluations make it (the job's streaming reader, its micro batch, the objective's
forward with predictions), times the passes the run made over that split (its logged evaluations, the
held-out pass with the selected model, one per robustness condition), and (b) the pages for `--examples`
examples (the model on them with the attention hook, the pictures drawn, the HTML written: what
`examples.log_run_examples` does before it logs). The run's own `time/end_of_run_s` (the same pages and
their logging, in the run) is reported beside them.
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
    p.add_argument("--examples", type=int, default=48, help="examples on the pages (default 48)")
    p.add_argument("--repeats", type=int, default=3, help="timings per figure; the median is reported (default 3)")
    p.add_argument("--out", default="bench-results", help="folder for examples.json and examples.md")
    p.add_argument("--work", help="scratch folder (default: the temporary folder)")


def run(args: argparse.Namespace) -> int:
    import shutil

    import torch

    from xmodal import tracking
    from xmodal.data.finetune.stream import iter_eval_batches, local_reader
    from xmodal.examples.build import write_pages
    from xmodal.examples.collect import (
        RunExamples,
        check_count,
        check_split,
        choose_rows,
        evaluate,
        get_run,
        open_set,
        run_task,
    )
    from xmodal.export.source import from_run
    from xmodal.objectives.finetune import FinetuneObjective
    from xmodal_bench import at_least, begin, write_results

    check_count(args.examples)
    at_least(args, 1, "repeats")
    work, stamp, meta = begin(args, "examples")
    started = time.monotonic()
    try:
        uri = tracking.resolve_tracking_uri(args.tracking_uri)
        r = get_run(uri, args.run_id, "--run-id")
        task = run_task(r, "--run-id")
        data = open_set(r, "--run-id")
        check_split(data, args.split, args.run_id)
        source = from_run(uri, args.run_id, work / "model")
        cfg = source.config or {}
        batch = int(cfg.get("train", {}).get("batch_size", 32)) // int(cfg.get("scale", {}).get("num_workers", 1))
        model = source.model
        objective = FinetuneObjective(model, task).eval()
        logged = len(tracking.metric_history(uri, args.run_id, f"{args.split}/accuracy"))
        robust = len(cfg.get("robust", {}).get("conditions", [])) if args.split == "valid" else 0
        passes = logged + 1 + robust

        def one_pass() -> float:
            t = time.perf_counter()
            with torch.no_grad():
                for b in iter_eval_batches(data, args.split, batch, reader=local_reader()):
                    objective(b, with_predictions=True)
            return time.perf_counter() - t

        def pages() -> float:
            t = time.perf_counter()
            size = len(data.split(args.split))
            notes: list[str] = []
            ex = evaluate(model, data, args.split, choose_rows(size, args.examples), notes)
            with tempfile.TemporaryDirectory(dir=work) as d:
                write_pages(RunExamples(args.run_id, r.name, task, args.split, str(data.path), ex, size, notes),
                            None, Path(d))
            return time.perf_counter() - t

        one_pass(), pages()  # warm: the first reads fill the page cache, the tokenizer and the index load
        # interleaved, so that both figures see the same load of a shared machine
        timed = [(one_pass(), pages()) for _ in range(args.repeats)]
        eval_s = statistics.median(t[0] for t in timed)
        pages_s = statistics.median(t[1] for t in timed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = eval_s * passes
    res = {"meta": {**meta, "wall_s": time.monotonic() - started, "run_id": args.run_id, "task": task,
                    "split": args.split, "split_examples": len(data.split(args.split)), "batch": batch,
                    "threads": torch.get_num_threads()},
           "eval_pass_s": eval_s, "passes": passes, "evaluation_s": total, "pages_s": pages_s,
           "examples": args.examples, "pages_share": pages_s / total,
           "run_end_of_run_s": r.metrics.get("time/end_of_run_s")}
    text = "\n".join([
        f"| {task} {args.split} ({res['meta']['split_examples']} examples, batch {batch}) | seconds |",
        "| --- | --- |",
        f"| one evaluation pass (median of {args.repeats}) | {eval_s:.3f} |",
        f"| the run's evaluation: {passes} passes | {total:.2f} |",
        f"| pages for {args.examples} examples (median of {args.repeats}) | {pages_s:.3f} |",
        f"| pages / evaluation | {100 * pages_s / total:.1f} % |",
        f"| the run's own time/end_of_run_s (pages and their logging) | "
        f"{res['run_end_of_run_s'] if res['run_end_of_run_s'] is not None else '-'} |",
    ])
    write_results(args.out, f"examples-{stamp}", res, text)
    return 0
