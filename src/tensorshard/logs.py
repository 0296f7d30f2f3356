"""Rank-aware logging: what the library's loggers emit, and from which process.

Every module of tensorshard takes its logger from ``get_logger(__name__)``: a standard ``logging.Logger`` (named
after the module, configured by the user's ``logging`` setup as usual) that carries one filter. In a job with a
``torch.distributed`` process group (torchrun) only the process of global rank 0 emits the library's records, so
a job of N processes logs each split, load or save once, not N times; in one process every record passes (the
in-process engine's devices are threads of that one process). Errors are raised, not logged, so a failure on
another rank still reaches its user as an exception on every rank.
"""

from __future__ import annotations

import logging

import torch.distributed as dist


class GlobalRankZeroOnly(logging.Filter):
    """Passes a record in the process of global rank 0, or where no process group is initialized."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


_RANK_ZERO_ONLY = GlobalRankZeroOnly()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the global-rank-0 filter added once (what each module's ``logger`` is)."""
    logger = logging.getLogger(name)
    if _RANK_ZERO_ONLY not in logger.filters:
        logger.addFilter(_RANK_ZERO_ONLY)
    return logger
