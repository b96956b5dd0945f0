"""See why a model fails: a finished run's examples as one self-contained page, `index.html`, the whole
viewer (the list with filters and sorting, the selected example's detail drawn in place), with each
example's picture(s) beside it; two runs side by side with McNemar's test (docs/tracking.md).

Cut by kind (`kinds.KINDS`: fine-tuning, pretraining's QA head, MulT), each mapping to its collect and its
render; the run is looked up once (`kinds.resolve`). Reads finished runs through `xmodal.tracking` and
their models through `xmodal.export.source`; never imports mlflow. Rooms, each importing only those below
it: build.py (the two doors: a folder from `jobs/examples.py`, the run's own pages at its end); kinds.py
(the table); finetune.py, pretrain.py, mult.py (each kind's data, collection and, for MulT, pages); qa.py
(LXMERT's examples and their pages, shared by fine-tuning and pretraining); viewer.py and draw.py (the
page's shell and script; the pictures); stats.py; pictures.py (where pictures come from); run.py (the run,
the errors, the choice of examples).
"""

from xmodal.examples.build import Built, end_of_run_pages, log_run_examples, make_examples
from xmodal.examples.run import ExamplesError

__all__ = ["Built", "ExamplesError", "end_of_run_pages", "log_run_examples", "make_examples"]
