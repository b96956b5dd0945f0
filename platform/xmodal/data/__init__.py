"""The data layer: stores on Parquet, their ingest, the batch builders and the readers.

One subpackage per kind of data, and the same roles under the same names in each (the same thing for
a different model, hence the repeated module names):

    lxmert/     LXMERT pretraining: image features with their sentences
    finetune/   fine-tuning sets (VQA, GQA, NLVR2) on an LXMERT store's images
    mult/       MulT's text, audio and vision streams (word-aligned or not)

    store.py      the store on disk: its manifest, shards and reads (finetune/sets.py for the sets)
    ingest.py     the reference's files -> a store (`jobs/ingest.py <kind>`)
    synthetic.py  a small learnable store of that kind (the embedded default)
    pipeline.py   the Ray Data reader of a training split (finetune/stream.py for the sets)

Shared by all kinds, one concern a module: `errors.py` (StoreError), `location.py` (where a store is
read from: a local path or a URI), `manifest.py` (typed manifests, kinds, the embedded defaults'
policy), `atomic.py` (kind-checked, staged publishing), `units.py` (a worker's share: units of row
groups), `prefetch.py` (batches a few ahead), `reader.py` (the one Ray Data read of units), `options.py`
(the synthetic stores' and masking options, plain dataclasses), `tokenizer.py`, `answers.py`.
"""
