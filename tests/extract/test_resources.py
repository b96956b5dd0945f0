"""The placement of an extraction on a cluster (`xmodal.extract.resources`): defaults, refusals and the
memory estimate of one detector call. No Ray: the cluster is described."""

from __future__ import annotations

import pytest

from xmodal.extract.images import ExtractError
from xmodal.extract.resources import (
    AUTO_BATCH_MAX,
    CPU_BATCH,
    CUDA_CONTEXT_BYTES,
    DEFAULT_GPU_SHARE,
    UNPROBED_GPU_BATCH,
    Cluster,
    batch_memory_bytes,
    place,
)
from xmodal.models.butd.detector import DetectorConfig

GIB = 2**30
FULL, TINY = DetectorConfig(), DetectorConfig.tiny()


def _place(cluster: Cluster, **given):
    args = {"actors": None, "gpus_per_actor": None, "decode_tasks": None, "batch_size": 4, "precision": "fp32",
            "cfg": FULL, **given}
    return place(cluster, **args)


def test_estimate_grows_with_the_batch_and_shrinks_in_bf16():
    one, two = batch_memory_bytes(FULL, 1, "fp32"), batch_memory_bytes(FULL, 2, "fp32")
    assert two == 2 * one  # no weights given: activations only, per image
    # bf16 halves the activations, not the NMS's float32 matrices and the pooling table
    assert one // 2 < batch_memory_bytes(FULL, 1, "bf16") < 0.6 * one and batch_memory_bytes(FULL, 1, "tf32") == one
    # at least the first res5 bottleneck over 300 regions at 14 x 14: input 1024, shortcut and output 2048,
    # two inner 512, float32
    res5 = 300 * 14 * 14 * (1024 + 2 * 2048 + 2 * 512) * 4
    assert res5 < one < 2 * res5
    assert batch_memory_bytes(FULL, 1, "fp32", params=1000) == one + 4000  # float32 weights
    assert batch_memory_bytes(TINY, 1, "fp32") < one / 4


def test_cpu_cluster_defaults_and_refusals():
    cpu = Cluster(cpus=16, gpus=(0.0,), memory=64 * GIB)
    assert _place(cpu) == _place(cpu, actors=1) and _place(cpu).gpus_per_actor == 0
    p = _place(cpu, actors=3)
    assert (p.actors, p.decode_tasks) == (3, 13)  # one CPU per detector actor, the rest decode
    assert _place(cpu, actors=16, batch_size=1).decode_tasks == 1 and _place(cpu, decode_tasks=5).decode_tasks == 5
    with pytest.raises(ExtractError, match=r"--actors 17: the cluster has 16 CPU\(s\) and no GPU"):
        _place(cpu, actors=17)
    with pytest.raises(ExtractError, match=r"--gpus-per-actor 0.5: the cluster has no GPU"):
        _place(cpu, gpus_per_actor=0.5)
    per_image = batch_memory_bytes(FULL, 1, "fp32")
    fits = int(64 * GIB / 2 // per_image)
    assert _place(cpu, actors=2, batch_size=fits).actors == 2
    with pytest.raises(ExtractError) as e:
        _place(cpu, actors=2, batch_size=fits + 1)
    assert str(e.value).startswith(f"--batch-size {fits + 1}: one detector call is estimated at ")
    assert f"the cluster's 64.0 GiB of memory over 2 actor(s)); expected a batch of at most {fits}" in str(e.value)


def test_gpu_cluster_two_actors_a_gpu_by_default():
    gpu = Cluster(cpus=32, gpus=(1.0, 1.0), memory=256 * GIB, gpu_memory=80 * GIB)
    p = _place(gpu)
    assert (p.actors, p.gpus_per_actor, p.decode_tasks) == (4, DEFAULT_GPU_SHARE, 28)
    assert _place(gpu, gpus_per_actor=1).actors == 2 and _place(gpu, gpus_per_actor=0.25).actors == 8
    assert _place(gpu, gpus_per_actor=0.3).actors == 6  # per node: floor(1 / 0.3) = 3
    with pytest.raises(ExtractError, match=r"--actors 5: the cluster's 2 GPU\(s\) place 4 detector actor\(s\) at "
                                           r"--gpus-per-actor 0.5; expected at most 4"):
        _place(gpu, actors=5)
    have = 0.5 * 80 * GIB - CUDA_CONTEXT_BYTES
    fits = int(have // batch_memory_bytes(FULL, 1, "fp32"))
    assert _place(gpu, batch_size=fits).actors == 4
    with pytest.raises(ExtractError, match=f"expected a batch of at most {fits} \\(or a larger --gpus-per-actor, or "
                                           "bf16\\)") as e:
        _place(gpu, batch_size=fits + 1)
    assert "0.5 of a 80.0 GiB GPU" in str(e.value)
    assert _place(gpu, batch_size=fits + 1, precision="bf16").actors == 4  # half the bytes
    # a GPU node that did not answer the memory question: the batch is not judged
    assert _place(Cluster(cpus=8, gpus=(1.0,), memory=GIB), batch_size=10**6).actors == 2


def test_batch_left_out_is_chosen_for_the_device():
    params = 65_000_000
    for gib, precision in ((80, "fp32"), (141, "fp32"), (80, "bf16"), (141, "bf16"), (24, "fp32")):
        gpu = Cluster(cpus=16, gpus=(1.0,), memory=128 * GIB, gpu_memory=gib * GIB)
        p = _place(gpu, batch_size=None, precision=precision, params=params)
        have = 0.5 * gib * GIB - CUDA_CONTEXT_BYTES
        # the largest batch the estimate fits, at most AUTO_BATCH_MAX
        assert p.batch_chosen and 1 <= p.batch_size <= AUTO_BATCH_MAX
        assert batch_memory_bytes(FULL, p.batch_size, precision, params) <= have
        assert (p.batch_size == AUTO_BATCH_MAX
                or batch_memory_bytes(FULL, p.batch_size + 1, precision, params) > have)
    h200 = Cluster(cpus=16, gpus=(1.0,), memory=128 * GIB, gpu_memory=141 * GIB)
    assert _place(h200, batch_size=None, precision="bf16", params=params).batch_size == AUTO_BATCH_MAX
    assert _place(h200, batch_size=None, gpus_per_actor=1, params=params).batch_size == AUTO_BATCH_MAX
    assert _place(h200, batch_size=None, gpus_per_actor=0.25, params=params).batch_size < AUTO_BATCH_MAX
    # given, it is kept and not marked chosen
    assert (_place(h200, batch_size=3).batch_size, _place(h200, batch_size=3).batch_chosen) == (3, False)
    unprobed = Cluster(cpus=8, gpus=(1.0,), memory=GIB)
    assert _place(unprobed, batch_size=None).batch_size == UNPROBED_GPU_BATCH
    cpu = Cluster(cpus=16, gpus=(0.0,), memory=64 * GIB)
    assert _place(cpu, batch_size=None).batch_size == CPU_BATCH
    assert _place(Cluster(cpus=2, gpus=(0.0,), memory=3 * GIB), batch_size=None).batch_size == 1  # what fits
    with pytest.raises(ExtractError) as e:
        _place(Cluster(cpus=8, gpus=(1.0,), memory=GIB, gpu_memory=4 * GIB), batch_size=None, gpus_per_actor=0.25)
    assert str(e.value).startswith("the detector does not fit an actor at one image a call: estimated at ")
    assert str(e.value).endswith("expected a larger --gpus-per-actor, or bf16")


def test_a_cpu_actor_runs_on_its_share_of_the_cores_not_the_one_cpu_ray_reserves():
    """Ray gives an actor that reserves one CPU one OpenMP thread: on a 2-core machine the job ran the
    network on one core while the reference one image at a time used both."""
    two = Cluster(cpus=2, gpus=(0.0,), memory=64 * GIB, node_cpus=(2,))
    p = _place(two)
    assert (p.actors, p.decode_tasks, p.threads_per_actor) == (1, 1, 2)  # still one CPU reserved: decode is placed
    assert _place(two, actors=2).threads_per_actor == 1
    node = Cluster(cpus=16, gpus=(0.0,), memory=64 * GIB, node_cpus=(16,))
    assert [_place(node, actors=n, batch_size=1).threads_per_actor for n in (1, 3, 16)] == [16, 5, 1]
    # two nodes: the actors are spread, one per node at 2, each on its node's cores
    nodes = Cluster(cpus=24, gpus=(0.0,), memory=64 * GIB, node_cpus=(16, 8))
    assert _place(nodes, actors=2).threads_per_actor == 12 and _place(nodes, actors=4, batch_size=1).threads_per_actor == 6
    assert _place(Cluster(cpus=6, gpus=(0.0,), memory=64 * GIB)).threads_per_actor == 6  # nodes unknown: one node
    # on GPUs the actors keep Ray's threads
    assert _place(Cluster(cpus=32, gpus=(1.0,), memory=256 * GIB, node_cpus=(32,))).threads_per_actor is None
