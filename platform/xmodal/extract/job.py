"""One extraction, from the options to the summary (`extract`): the plan, the run, the publish.

    plan.check(options) -> Plan      every check that needs no Ray, each input read once, the work already
                                     done verified (module `plan`)
    run.run(plan) -> Outcome         Ray, the cluster's checks, the pipeline; the write tasks write the
                                     shards, the driver keeps their names, ids and rows (module `run`)
    publish.publish(plan, outcome)   the commit: manifest and rename, or manifest last on S3; or the TSV
                                     file (module `publish`)

Bad input fails in `check`, before Ray starts, and nothing is written. A run that fails or is
interrupted keeps the shards it wrote at the output's root (`.OUT.extract` beside a local OUT, or OUT
itself on S3, where readers ignore a prefix without a manifest) and the same command resumes from them;
a root that holds no finished shard is removed, so that it blocks no other run.
"""

from __future__ import annotations

from xmodal.base.errors import UserError
from xmodal.extract.plan import RANDOM, ExtractOptions, check
from xmodal.extract.publish import Summary, publish
from xmodal.extract.run import run


def extract(o: ExtractOptions) -> Summary:
    """Run one extraction (module docstring); every line it says carries RANDOM WEIGHTS when they are."""
    try:
        plan = check(o)
        return publish(plan, run(plan))
    except UserError as e:
        if o.random_weights and RANDOM not in str(e):
            raise type(e)(f"{e} ({RANDOM})") from None
        raise
