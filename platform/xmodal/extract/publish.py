"""An extraction's publish (`publish(plan, outcome) -> Summary`): the driver commits what the write
tasks wrote, from the plan and the run's records alone.

- A store: the shards an earlier run left (verified by the plan) and this run's, sorted by name, are
  committed by the store's writer (`FeatureWriter.commit`): every other shard of the root removed, the
  manifest (kind "features", source "extract", the run's options, the weights' sha256, the rejects'
  count) and `rejects.jsonl` written, the store checked, then renamed into place (a local OUT) or its
  manifest written last (a URI).
- A TSV (`--format tsv`): the shards' lines concatenated into the file, staged and published under the
  output policy (`base/outputs.Output`), with the rejects' list `OUT.rejects.jsonl` beside it; the
  shards' root is removed after.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from xmodal.data.lxmert.features import KIND, SCHEMA_VERSION, FeatureManifest, FeatureShard
from xmodal.extract.images import ExtractError
from xmodal.extract.plan import Plan
from xmodal.extract.run import Outcome
from xmodal.extract.write import REJECTS_FILE


@dataclass
class Summary:
    out: str
    written: int  # images with features at OUT (this run's and the earlier runs' it resumed)
    extracted: int  # by this run
    skipped: int  # done by an earlier run
    rejected: int
    seconds: float
    rejects: str | None  # the list of rejects, where there were any
    driver_cpu_s: float = 0.0  # the driver's CPU time over the pipeline (`run.Outcome`)
    driver_bytes: int = 0  # the bytes of the records it received
    write_s: float = 0.0  # the write tasks' own time, summed
    write_bytes: int = 0  # the bytes they wrote
    write_shards: int = 0  # the shards this run wrote

    def lines(self) -> list[str]:
        rate = self.extracted / self.seconds if self.seconds > 0 else 0.0
        out = [f"extracted {self.extracted} images in {self.seconds:.1f} s ({rate:.2f} images/s); skipped "
               f"{self.skipped} already done; rejected {self.rejected}",
               f"wrote {self.out}: {self.written} images"]
        if self.rejects is not None:
            out.append(f"rejected images and why: {self.rejects}")
        return out


def _rejects(outcome: Outcome) -> bytes | None:
    if not outcome.rejects:
        return None
    return "".join(json.dumps({"path": p, "img_id": i, "reason": r}) + "\n" for p, i, r in outcome.rejects).encode()


def publish(plan: Plan, outcome: Outcome) -> Summary:
    """Commit the output (module docstring) and say what was done."""
    shards = sorted([*plan.done.verified.values(), *outcome.shards], key=lambda s: s.name)
    n = len(outcome.rejects)
    if not shards:
        plan.writer.discard_if_empty()  # nothing to resume: no root is left to block the next run
        raise ExtractError(f"IMAGES {plan.images}: every image was rejected ({n}; each listed above with why); "
                           f"nothing was written at {plan.out}")
    rejects = _rejects(outcome)
    if plan.tsv is None:
        cfg = plan.spec.cfg

        def manifest(files: list[FeatureShard], digest: str) -> FeatureManifest:
            return FeatureManifest(schema_version=SCHEMA_VERSION, kind=KIND, num_objects=plan.spec.num_objects,
                                   feat_dim=cfg.feature_dim, num_object_labels=cfg.num_classes,
                                   num_attr_labels=cfg.num_attributes, shards=files, source="extract",
                                   inputs=plan.inputs, content_sha256=digest,
                                   options={**plan.manifest_options, "rejected": n})

        out = str(plan.writer.commit(shards, manifest, {REJECTS_FILE: rejects}))
        where = f"{out}/{REJECTS_FILE}"
    else:
        out, where = _publish_tsv(plan, shards, rejects)
    written = sum(s.rows for s in shards)
    summary = Summary(out, written, outcome.extracted, written - outcome.extracted, n,
                      time.monotonic() - plan.began, where if n else None, outcome.driver_cpu_s, outcome.driver_bytes,
                      sum(s.seconds for s in outcome.shards), sum(s.bytes for s in outcome.shards), len(outcome.shards))
    for line in summary.lines():
        plan.tell(line)
    return summary


def _publish_tsv(plan: Plan, shards, rejects: bytes | None) -> tuple[str, str]:
    assert plan.tsv is not None and plan.rejects is not None
    with plan.tsv.stage() as stage:
        plan.writer.lines_to(shards, stage.tmp)
        if rejects is not None:
            with plan.rejects.stage() as listed:
                Path(listed.tmp).write_bytes(rejects)
                listed.publish()
        elif plan.rejects.overwrite and plan.rejects.path.is_file():
            plan.rejects.path.unlink()  # the replaced TSV's own list (--overwrite)
        stage.publish()
    plan.writer.remove_work()
    return str(plan.tsv.path), str(plan.rejects.path)
