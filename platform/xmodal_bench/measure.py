"""What the benchmarks share about the machine they measure: the accelerator's peak for MFU, and the
peak CPU memory of a train step (from torch.profiler's memory timeline, with kineto's own log lines
kept off the console)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from xmodal.base.console import say
from xmodal.core.step import TrainState, train_step

H200_BF16_DENSE_TFLOPS = 989.0  # an H200's dense bf16 peak (NVIDIA's data sheet), the MFU denominator


# A line of kineto's own log (torch.profiler's C++ library): `USDT:2026-12-03 21:10:40 5398:5398
# SyncActivityProfilerHandler.cpp:52] profiler_start`. Kineto writes them to stderr from C++ (std::cerr);
# the USDT ones on every profile, whatever KINETO_LOG_LEVEL says, so no setting keeps them off the console.
KINETO_LINE = re.compile(r"^(USDT|STAGE|INFO|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\] ")


@contextlib.contextmanager
def without_kineto_lines() -> Iterator[None]:
    """While it runs, the process's stderr (file descriptor 2, where C++ writes) goes to a temporary
    file; after, every line written there that is not one of kineto's informational lines is passed
    on to stderr (a warning or error, Python's or kineto's, still shows)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not KINETO_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def cpu_peak_tensor_bytes(state: TrainState, batch) -> int | None:
    """Peak bytes of live CPU tensors during one train step (parameters, optimizer state, batch,
    activations, gradients): the CPU analogue of max_memory_allocated, from the torch.profiler memory
    timeline (a private API, guarded: None when it is not there). Kineto's log lines stay off the
    console (`without_kineto_lines`)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with without_kineto_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                             record_shapes=True, with_stack=True) as prof:
            train_step(state, [batch])
        timeline = prof._memory_profile().timeline
    except Exception as err:  # noqa: BLE001 - a missing memory figure must not fail the suite
        say(f"note: no CPU memory figure ({type(err).__name__}: {err})")
        return None
    live = peak = 0
    for _, action, (key, _), size in timeline:
        if key.device.type != "cpu":
            continue
        if action.name in ("PREEXISTING", "CREATE"):
            live += size
        elif action.name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak
