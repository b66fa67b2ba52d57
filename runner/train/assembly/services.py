"""The services of one rank's run: what every part of it reads (the recipe, its plan, the rank's
place) and reports through (the collective, the live view, the metrics log), fixed once the
assembly (``runner.train.assembly.assemble``) has built them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from runner.precision import Precision
from runner.ranks.collective import Collective
from runner.ranks.context import RankContext
from runner.recipe.plan import RunPlan
from runner.recipe.schema import Recipe
from runner.state.run_folder import RunLock
from runner.ui import MetricsLog, Reporter

if TYPE_CHECKING:
    from accelerate import Accelerator


@attrs.frozen(eq=False)
class RunServices:
    """One rank's run services, shared by the loop, the steps and the roles."""

    recipe: Recipe
    plan: RunPlan
    rank: RankContext
    comm: Collective
    reporter: Reporter
    metrics: MetricsLog
    precision: Precision  # decided once per rank (runner.precision.resolve)
    accelerator: Accelerator
    stop_poll: Callable[[], bool] | None = None  # the launcher asks for a stop (Ray actors)
    lock: RunLock | None = None  # rank 0's lock on the run folder, held until the run closes
