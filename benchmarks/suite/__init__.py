"""The benchmark suite's shared parts: model sizes (config.py), measuring tools (measure.py), launching
jobs in subprocesses (launch.py), the systems under test (systems.py) and the job runners (job.py for our
code, DTensor and transformers; peer_job.py for the tensor_parallel package in its own environment)."""
