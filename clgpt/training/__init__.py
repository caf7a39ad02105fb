"""Training: the loop, what it trains from, data parallelism over MPI and hyperparameter sweeps.

    train.py          the loop: schedules, accumulation, clipping, checkpoints, resume, the CSV log
    train_inputs.py   what a stage trains from: encoded data, a new or the pretrained model, input hashes
    dist.py           data parallelism over MPI: a rank's rows and device, the fixed-order all-reduce
    launch.py         `python -m clgpt.training.launch`: the stage's mpiexec/srun line, naming a rank that dies
    sweep.py          the `sweep:` section as one validated config per run; the summary
"""
