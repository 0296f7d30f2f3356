"""What a profile showed for each target we missed, and what would close the gap: written by hand from the
investigation behind BENCHMARKS.md, keyed by the target's key in targets.py. render.py prints an entry only
when its target is missed in the run being rendered."""

ANALYSIS: dict[str, str] = {}
