"""The device layer: which OpenCL device runs, what it can do, and the switches that steer it.

    opencl.py      device choice (`resolve_device`, a probe kernel per candidate), the program loader and cache
    icd.py         the OpenCL runtimes pip installs (Intel's CPU runtime), registered with the ICD loader
    knobs.py       every environment knob of ours, read once into a `Knobs` record
    tuning.py      the per-device table: matmul kernel, tiles and launch style for a CPU, an NVIDIA GPU, another GPU
    precision.py   the `precision` setting and which matrix path a device has
    sm90a.py       edits of an NVIDIA program's PTX (sm_90a, register caps)
"""
