"""How an extraction is spread over the cluster: the defaults of `--actors`, `--gpus-per-actor` and
`--decode-tasks`, and the checks of those and of `--batch-size` against the cluster, made in the
driver once Ray is reached and before the pipeline starts (one `error:` line each).

- `--gpus-per-actor F` (0 < F <= 1): the share of a GPU each detector actor takes; default 0.5 on a
  cluster with GPUs (two actors a GPU), 0 on a CPU cluster.
- `--actors N`: default as many as the cluster's GPUs place at that share (per node: floor(GPUs / F)),
  else 1 on CPU; more than that (or than the CPUs of a CPU cluster) is refused.
- `--decode-tasks`: default the cluster's CPUs less one per detector actor (each takes a CPU), at
  least 1, so that decoding keeps up with the detectors.
- Torch threads of a CPU detector actor: Ray gives a worker that asks for one CPU one OpenMP thread
  (it sets OMP_NUM_THREADS to the CPUs it reserved), so the actor would run the network on one core
  while the others wait for decode work that takes a hundredth of the time. A CPU actor runs with its
  share of its node's cores (the node's CPUs over the actors placed there, at least 1); it still
  reserves one CPU from Ray, so that the decode tasks are placed (an actor reserving every CPU would
  leave them none and the run would wait forever).
- `--batch-size`: `batch_memory_bytes` estimates what one detector call holds on its device, against
  the actor's share of a GPU's memory (asked of a GPU node) or, on CPU, the cluster's memory per actor.
  An estimate: the activations of the largest input the detector makes (the reference's 600 x 1000:
  its input's short side by the long side's cap, `--input-size`) through the
  backbone and of the RoI head over its 300 regions per image, not a measurement of the allocator.
  Left out, it is chosen: on a GPU the largest batch the estimate fits in the actor's share, at most
  `AUTO_BATCH_MAX` (the host's work per image falls with the batch, and past 64 it is under a
  millisecond); `UNPROBED_GPU_BATCH` where no GPU node told its memory; `CPU_BATCH` on CPU (a CPU
  actor runs the backbone one image at a time, so a larger batch gains nothing there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xmodal.extract.images import ExtractError

ACTIVATION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2}  # tf32 computes in float32's storage
DEFAULT_GPU_SHARE = 0.5
CUDA_CONTEXT_BYTES = 1 << 30  # what a process's CUDA context and kernels take before any tensor
GPU_PROBE_TIMEOUT_S = 60.0
AUTO_BATCH_MAX = 64
UNPROBED_GPU_BATCH = 8
CPU_BATCH = 4


@dataclass(frozen=True)
class Cluster:
    cpus: int
    gpus: tuple[float, ...]  # each alive node's GPUs
    memory: int  # bytes: Ray's `memory` resource over the cluster
    gpu_memory: int | None = None  # one GPU's, where a GPU node was asked
    node_cpus: tuple[int, ...] = ()  # each alive node's CPUs (unknown: the cluster's as one node)

    @property
    def total_gpus(self) -> float:
        return sum(self.gpus)


@dataclass(frozen=True)
class Placement:
    actors: int
    gpus_per_actor: float  # 0 on CPU
    decode_tasks: int
    batch_size: int
    batch_chosen: bool = False  # chosen here, not given
    threads_per_actor: int | None = None  # a CPU actor's torch threads; None on GPU (Ray's default)


def cpu_threads(cluster: Cluster, actors: int) -> int:
    """A CPU detector actor's torch threads: its share of its node's cores. Ray spreads the actors over
    the CPU nodes, so a node holds about actors / nodes of them; no actor takes more than its node has."""
    nodes = [c for c in cluster.node_cpus if c > 0] or [cluster.cpus]
    per_node = math.ceil(actors / len(nodes))
    return max(1, min(max(nodes) // per_node, cluster.cpus // max(1, actors)))


def batch_memory_bytes(cfg, batch_size: int, precision: str, params: int = 0) -> int:
    """Device memory of one detector call over `batch_size` images of the largest size, estimated
    from the detector's config (`DetectorConfig`): per image, the largest working set of a backbone
    bottleneck (its input, shortcut, two inner and one output activation), the res4 features and RPN
    activations kept for the head, the proposal NMS's float32 matrices over its window (about ten
    of window x window while they are built), ROI pooling's table of block maxima over the res4 map,
    the pooled regions, and the first res5 bottleneck over all regions at 14 x 14; in the precision's
    bytes (the NMS and the table in float32), plus the float32 weights (`params`)."""
    h, w = cfg.input.scale, cfg.input.max_size  # the largest input the detector makes
    act = ACTIVATION_BYTES[precision]
    bb, rpn, head = cfg.backbone, cfg.rpn, cfg.roi_head
    out = [bb.stage_out(i) for i in (2, 3, 4, 5)]
    mid = [bb.width * 2**i for i in range(4)]
    positions = [h * w // 16 // 4**i for i in range(3)]  # res2 at 1/4, res3 at 1/8, res4 at 1/16
    stem = 3 * h * w + bb.stem_width * (h * w // 4)
    blocks = [((out[i - 1] if i else bb.stem_width) + 2 * out[i] + 2 * mid[i]) * positions[i] for i in range(3)]
    backbone = max(stem, *blocks) + (out[2] + 2 * rpn.channels) * positions[2]
    side = math.ceil(h / 16), math.ceil(w / 16)
    levels = [max(min(s, math.ceil((s + 2) / head.pooled_size) + 1), 1).bit_length() for s in side]
    float32 = 10 * min(rpn.nms_window, rpn.pre_nms_top_n) ** 2 + levels[0] * levels[1] * positions[2] * out[2]
    float32 += 4 * rpn.pre_nms_top_n  # the window NMS's masks and orders over every candidate
    regions = rpn.post_nms_top_n * head.pooled_size ** 2
    roi_head = regions * out[2] + regions * (out[2] + 2 * out[3] + 2 * mid[3])
    return int(4 * params + batch_size * ((backbone + roi_head) * act + 4 * float32))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def place(cluster: Cluster, *, actors: int | None, gpus_per_actor: float | None, decode_tasks: int | None,
          batch_size: int | None, precision: str, cfg, params: int = 0) -> Placement:
    """The run's actors, GPU share, decode tasks and batch on `cluster` (`batch_size` None: chosen, see the
    module's text); an ExtractError names the option, its value and what the cluster takes."""
    gpus = cluster.total_gpus
    if gpus_per_actor is not None and gpus <= 0:
        raise ExtractError(f"--gpus-per-actor {gpus_per_actor:g}: the cluster has no GPU; leave it out on a CPU "
                           "cluster")
    share = (gpus_per_actor if gpus_per_actor is not None else DEFAULT_GPU_SHARE) if gpus > 0 else 0.0
    if share:
        fits = sum(int(math.floor(g / share + 1e-9)) for g in cluster.gpus)
        if actors is not None and actors > fits:
            raise ExtractError(f"--actors {actors}: the cluster's {gpus:g} GPU(s) place {fits} detector actor(s) at "
                               f"--gpus-per-actor {share:g}; expected at most {fits} (or a smaller share)")
        n = actors or max(1, fits)
    else:
        if actors is not None and actors > cluster.cpus:
            raise ExtractError(f"--actors {actors}: the cluster has {cluster.cpus} CPU(s) and no GPU, one CPU per "
                               f"detector actor; expected at most {cluster.cpus}")
        n = actors or 1
    if share and cluster.gpu_memory:
        have = share * cluster.gpu_memory - CUDA_CONTEXT_BYTES
        where = f"{share:g} of a {_gib(cluster.gpu_memory)} GPU, less {_gib(CUDA_CONTEXT_BYTES)} for CUDA"
    elif not share:
        have = cluster.memory / n
        where = f"the cluster's {_gib(cluster.memory)} of memory over {n} actor(s)"
    else:
        have = None
    per_image = batch_memory_bytes(cfg, 1, precision) - batch_memory_bytes(cfg, 0, precision)
    fit = None if have is None else max(0, int((have - 4 * params) // per_image))
    chosen = batch_size is None
    if chosen:
        most = AUTO_BATCH_MAX if share and fit is not None else UNPROBED_GPU_BATCH if share else CPU_BATCH
        batch_size = most if fit is None else min(most, fit)
        if batch_size < 1:
            raise ExtractError(f"the detector does not fit an actor at one image a call: estimated at "
                               f"{_gib(batch_memory_bytes(cfg, 1, precision, params))} ({precision}), more than an "
                               f"actor's {_gib(max(0, have or 0))} ({where}); expected "
                               + ("a larger --gpus-per-actor, or bf16" if share else "fewer --actors"))
    need = batch_memory_bytes(cfg, batch_size, precision, params)
    if have is not None and need > have:
        raise ExtractError(f"--batch-size {batch_size}: one detector call is estimated at {_gib(need)} "
                           f"({precision}, {cfg.input.scale} x {cfg.input.max_size} images, "
                           f"{cfg.rpn.post_nms_top_n} regions each), more than an actor's {_gib(max(0, have))} ({where}); "
                           f"expected a batch of at most {fit}" + (" (or a larger --gpus-per-actor, or bf16)"
                                                                    if share else ""))
    tasks = decode_tasks if decode_tasks is not None else max(1, cluster.cpus - n)
    return Placement(n, share, tasks, batch_size, chosen, None if share else cpu_threads(cluster, n))


def cluster_view(probe_gpu: bool = True) -> Cluster:
    """The connected Ray cluster's CPUs, GPUs per node and memory; with `probe_gpu`, one GPU's memory
    asked of a GPU node by a tiny task (None when no GPU node answers within a minute)."""
    import ray

    total = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    nodes = tuple(float(n["Resources"].get("GPU", 0)) for n in alive)
    gpu_memory = None
    if probe_gpu and sum(nodes) > 0:
        @ray.remote(num_gpus=0.01, num_cpus=0)
        def total_memory() -> int:
            import torch

            return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 0

        ref = total_memory.remote()
        try:
            gpu_memory = ray.get(ref, timeout=GPU_PROBE_TIMEOUT_S) or None
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
    return Cluster(cpus=int(total.get("CPU", 0)), gpus=tuple(g for g in nodes if g > 0) or (0.0,),
                   memory=int(total.get("memory", 0)), gpu_memory=gpu_memory,
                   node_cpus=tuple(int(n["Resources"].get("CPU", 0)) for n in alive))


PROBE_TIMEOUT_S = 120.0


def probe_nodes(out: str, folder: str, record: str) -> None:
    """Before any work: every alive node but the driver's, where write tasks may run, sees the driver's
    `record` (a file it just wrote at the output's root) and can write into `folder`, by one small task
    each, pinned there. A local OUT that is not on a file system every host shares (or that a host may
    not write), or an `s3://` OUT a host has no credentials for, fails here naming the host."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    if not nodes:
        return
    task = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
        folder, record) for n in nodes]
    for n, ref in zip(nodes, refs, strict=True):
        try:
            why = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            why = f"did not answer a probe task ({type(e).__name__})"
        if why:
            raise ExtractError(f"OUT {out}: the worker host {n['NodeManagerAddress']} {why}; the shards are written "
                               "by tasks on every host, so OUT must be on a file system every host shares and may "
                               "write (or an s3:// prefix every host has credentials for)")


def _probe(folder: str, record: str) -> str:
    """Why this node cannot write the output's shards ("" when it can)."""
    import uuid

    import pyarrow as pa

    from xmodal.data.location import Location

    try:
        Location(record).read_bytes()
    except OSError as e:
        return f"does not see the file the driver wrote at {record} ({type(e).__name__}: {e})"
    probe = Location(folder) / f".probe-{uuid.uuid4().hex[:8]}"
    try:
        with probe.fs.open_output_stream(probe.fs_path) as f:
            f.write(b"probe")
        probe.fs.delete_file(probe.fs_path)
    except (OSError, pa.ArrowException) as e:
        return f"cannot write into {folder} ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    return ""
