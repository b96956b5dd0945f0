"""The jobs: one spec module per job, each the same thing (a `xmodal.runner.spec.JobSpec`) for a
different model or task; the runner runs them all.

    pretrain_job.py   LXMERT pretraining (the five tasks, each switchable)
    finetune_job.py   VQA, GQA and NLVR2 fine-tuning, and where its starting weights come from
    mult_job.py       MulT on the sentiment stores
    chain_job.py      pretraining then fine-tuning from its weights, as one job
    predictions.py    fine-tuning's prediction files
    registry.py       job name -> spec: the one table the command lines and the sweep look jobs up in

The command-line scripts in the repository's `jobs/` folder only parse arguments and call into these.
"""
