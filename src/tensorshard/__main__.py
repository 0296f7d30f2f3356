"""`python -m tensorshard plan llama --devices 4`: the command line (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
