"""The runner: how any job's spec is run, once for all jobs (Ray Train, MLflow, checkpoints, resume,
faults, Ctrl-C).

    spec.py         the JobSpec contract and the plan and result types a spec and the engine share
    engine.py       the driver: check, open the MLflow run, train on Ray Train, finish (run, run_job)
    worker.py       a Train worker: build, prepare, restore, fit with the hooks
    hooks.py        logging, evaluation, checkpoints and the run's score, on every worker
    session.py      where a worker reports: Ray Train, or Tune in a trial's own process
    run_record.py   what a run records in MLflow besides its metrics
    recovery.py     the newest checkpoint that verifies, for a resume
    faults.py       test-only fault injection (train.fail_at_step, train.random_faults)
    interrupt.py    Ctrl-C and SIGTERM: stop at a checkpoint
    ray_cluster.py  connecting to Ray (a local one started and retried), the workers' lines to the
                    console, where runs are stored
    gloo.py         the network interface of a worker's process group
    inprocess.py    the same worker in this process, without Ray or MLflow
    timeline.py     where a run's wall time goes (time/* metrics)
"""
