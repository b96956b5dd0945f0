"""See why a model fails: a fine-tuning run's evaluated examples as static HTML pages, each with its
picture and boxes (named by the detector's vocabularies), the question, the gold and predicted answers
and the cross-modality attention of every word over the boxes, per layer and head; a summary page; and
two runs side by side with McNemar's test of their disagreements (docs/tracking.md).

Reads finished runs through `xmodal.tracking` and their models through `xmodal.export.source`; never
imports mlflow. Rooms, each importing only those before it: collect.py (the run, its set, its model on
the chosen examples), stats.py (summaries, the comparison), draw.py and pages.py (PNG pictures, HTML),
build.py (the pages whole, into a folder or into the run: at the end of a job's run and of a sweep's
trial, `end_of_run_pages`).
"""

from xmodal.examples.build import Built, end_of_run_pages, log_run_examples, make_examples
from xmodal.examples.collect import ExamplesError

__all__ = ["Built", "ExamplesError", "end_of_run_pages", "log_run_examples", "make_examples"]
