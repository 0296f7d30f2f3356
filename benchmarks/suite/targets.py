"""The speed targets we set ourselves (issues 7 and 13), and how a speed result is checked against them.

Ratios are of medians measured in the same run. "Speed-up" is the 1-device time over the 2-device time of
the same system; "slowdown" is a time over the unsplit model's time for the same work.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Target:
    key: str
    what: str
    system: str
    task: str  # train | infer
    metric: str  # step | forward | generate
    goal: float
    kind: str  # "speedup" (>= goal) or "slowdown" (<= goal)
    world: int = 2
    profile: tuple[str, ...] = ()  # variants to profile when missed

    def check(self, speed: dict) -> dict:
        """{"value", "met", "by"} from a speed.json dict, or {"value": None, "why"} when not measured. `by`: for a
        speed-up, how far below the goal it is (0.25: 25% short); for a slowdown, how far above."""
        if self.kind == "speedup":
            one, two = median(speed, self.task, self.system, 1, self.metric), median(speed, self.task, self.system, self.world, self.metric)
            if one is None or two is None:
                return {"value": None, "why": "not measured (a run failed)"}
            value = one / two
            met = value >= self.goal
            by = 1 - value / self.goal  # the share of the goal's speed-up not reached
        else:
            base, mine = median(speed, self.task, "plain", 1, self.metric), median(speed, self.task, self.system, self.world, self.metric)
            if base is None or mine is None:
                return {"value": None, "why": "not measured (a run failed)"}
            value = mine / base
            met = value <= self.goal
            by = value / self.goal - 1
        return {"value": value, "met": met, "by": by}


TARGETS = (
    Target(key="torchrun-train", what="torchrun engine: training step at 2 devices vs 1 device", system="ours-torchrun",
           task="train", metric="step", goal=1.8, kind="speedup", profile=("ours-torchrun:1", "ours-torchrun:2")),
    Target(key="inprocess-train", what="in-process engine: training step at 2 devices vs 1 device (issue 13)",
           system="ours-inprocess", task="train", metric="step", goal=1.7, kind="speedup",
           profile=("ours-inprocess:1", "ours-inprocess:2")),
    Target(key="inprocess-forward", what="in-process engine: forward at 2 devices vs 1 device (issue 13)",
           system="ours-inprocess", task="infer", metric="forward", goal=1.85, kind="speedup", profile=("ours-inprocess:1", "ours-inprocess:2")),
    Target(key="generate", what="in-process engine: greedy generation per token at 2 devices / unsplit model",
           system="ours-inprocess", task="infer", metric="generate", goal=1.3, kind="slowdown", profile=("plain:1", "ours-inprocess:2")),
    Target(key="torchrun-generate", what="torchrun engine: greedy generation per token at 2 devices / unsplit model",
           system="ours-torchrun", task="infer", metric="generate", goal=1.3, kind="slowdown", profile=("ours-torchrun:2",)),
    *(
        Target(key=f"overhead-{system}-{metric}", what=f"{label}: {what} at 1 device / unsplit model", system=system,
               task=task, metric=metric, goal=1.03, kind="slowdown", world=1, profile=("plain:1", f"{system}:1"))
        for system, label in (("ours-inprocess", "in-process engine"), ("ours-torchrun", "torchrun engine"))
        for task, metric, what in (("train", "step", "training step"), ("infer", "forward", "forward"), ("infer", "generate", "generation"))
    ),
)


def median(speed: dict, task: str, system: str, world: int, metric: str) -> float | None:
    """The median seconds of `metric` for `system` at `world` devices in the main measurements of the run
    (the first one found: the unsplit model's drift check at the end of the run does not count)."""
    for v in speed.get(task, []):
        if v.get("system") == system and v.get("world") == world and isinstance(v.get(metric), dict):
            return v[metric]["median"]
    return None
