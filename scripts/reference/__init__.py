"""Checks of our code against the references' own code, run unchanged from their checkouts.

    common.py     what every check shares: importing a reference checkout's files (Python 2 ones
                  too), the numpy the reference ran under, argument checks with one `error:` line,
                  outputs under the project's output policy (`xmodal.base.outputs`)
    caffe.py      a stand-in `caffe` module: the prototxt's layers in Caffe's semantics, on torch
    extractor.py  the extractor against bottom-up-attention's Python as LXMERT's extraction script
                  runs it (`python scripts/reference/extractor.py --help`)
    photos.py     the photographs the extractor's check runs on
    compare.py    the extractor's comparison: slot by slot, the first differing stage, proven ties
    recipes.py    the references' own training loops (LXMERT's VQA and pretraining, MulT's) against our
                  jobs' step for step (`python scripts/reference/recipes.py --help`)

Each check is a command line: `python scripts/reference/NAME.py ...`, from any folder.
"""
