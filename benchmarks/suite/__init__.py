"""The benchmark suite's shared parts: model sizes (config.py), measuring tools (measure.py), launching jobs in
subprocesses (launch.py), the systems under test (systems.py), the job runners (job.py for our code, DTensor
and transformers; peer_job.py for the tensor_parallel package in its own environment), the targets
(targets.py), and the report: sections.py and plots.py render results, analysis.py holds the notes on
missed targets."""
