"""The command lines: the training jobs' (jobs.py), ingest's (ingest.py) and extract's (extract.py)."""
