"""The packing planner: which configs train together, on how many GPUs, and when.

Three layers, after the paper's §6:

* :mod:`plora.planner.ilp` -- F(d, K), the best single job on d GPUs (Eq. 18-19), solved
  exactly (threshold enumeration + Dinkelbach over exact knapsacks, :mod:`.knapsack`);
* :mod:`plora.planner.dtm` -- Alg. 1, the max-throughput set of concurrent jobs on g GPUs;
* :mod:`plora.planner.schedule` -- Alg. 2, the job planner: simulates completions into a
  :class:`Plan` (:func:`plan_sweep`, and :func:`replan` for the online coordinator);

plus :mod:`.bounds` (lower bound, Thm 6.1), :mod:`.baselines` (Min GPU, Max GPU,
Sequential, Tune), :mod:`.groups` (resident worker groups: who pays a start-up) and
:mod:`.guard` (:func:`choose_plan`: never adopt a re-plan predicted slower than continuing).
Pure: no Ray, no I/O, no printing. Costs come only through :class:`plora.cost.CostModel`.
"""

from __future__ import annotations

from plora.planner.baselines import baseline_plan
from plora.planner.guard import PlanChoice, PlanChoiceKind, choose_plan, continue_plan
from plora.planner.schedule import plan_sweep, replan
from plora.planner.types import Baseline, Job, NoFeasibleJobError, Objective, Plan

__all__ = [
    "Baseline",
    "Job",
    "NoFeasibleJobError",
    "Objective",
    "Plan",
    "PlanChoice",
    "PlanChoiceKind",
    "baseline_plan",
    "choose_plan",
    "continue_plan",
    "plan_sweep",
    "replan",
]
