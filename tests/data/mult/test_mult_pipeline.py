"""MulT Ray Data pipeline: two workers split an epoch of a store; contents equal the numpy path."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from xmodal.data.mult.store import write_store
from xmodal.data.mult.synthetic import SyntheticMultOptions, generate


def test_two_workers_split_an_epoch(ray_local, tmp_path: Path):
    from xmodal.data.mult.pipeline import iter_mult_batches, mult_dataset

    store = write_store(tmp_path / "syn", generate(SyntheticMultOptions(num_samples=80, seed=2)),
                        dataset="synthetic", source={}, shard_rows=12)
    whole = store.split("train")
    ds = mult_dataset(store, "train", seed=0)
    its = ds.streaming_split(2, equal=True)
    seen = []
    results: dict[int, list] = {}

    def consume(rank: int) -> None:
        results[rank] = list(iter_mult_batches(its[rank], store.dims, 8, epoch=0, seed=0, rank=rank,
                                               drop_last=False, pad_to="store", max_len=store.manifest.max_len))

    # Streaming-split iterators are consumed concurrently, as by two Train workers.
    threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(results) == {0, 1}
    for rank in (0, 1):
        for b in results[rank]:
            assert b.audio.shape[1] == store.manifest.max_len["audio"]  # static shapes
            for i, r in enumerate(b.index.tolist()):
                n = int(b.text_lengths[i])
                np.testing.assert_array_equal(b.text[i, :n].numpy(), whole.batch([r]).text[0].numpy())
                assert float(b.labels[i, 0]) == pytest.approx(float(whole.labels[r]))
            seen += b.index.tolist()
    assert len(seen) == len(set(seen)) and len(seen) >= len(whole) - 1  # equal=True may drop one row
