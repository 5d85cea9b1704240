"""The step loop shared by dspec's small trainers (drafters, mask adapters).

:class:`BudgetedLoop.train` runs ``train_step`` until a step cap or a time budget: a budget
fixes the schedule's length (``total_steps``) after 10 measured steps, so the cosine schedule
ends inside the budget, then re-plans it every ``REPLAN_EVERY`` steps over the first
``REPLAN_FRACTION`` of the budget from the pace measured so far, evaluations and checkpoints
included (the first steps of a run over a cold memory-mapped feature cache ran 1.6x slower
than the rest: a length fixed on them left 38 % of a 60-minute budget unused).  The length
is checkpointed so ``--resume`` continues the same schedule.  A subclass provides ``cfg``
(``max_steps``, ``eval_every``, ``checkpoint_every_s``), ``step``, ``total_steps``, ``log``,
``evals``, ``wall_s``, ``progress``, ``progress_desc`` and the methods ``train_step() ->
float``, ``evaluate() -> float`` (appending ``{"step", "heldout_loss", ...}`` to ``evals``)
and ``save_checkpoint()``.
"""

from __future__ import annotations

import time

__all__ = ["BudgetedLoop", "REPLAN_EVERY", "REPLAN_FRACTION", "fit_length"]

REPLAN_EVERY = 50  # steps between re-plans of the schedule's length
REPLAN_FRACTION = 0.25  # re-plan only while this much of the budget has passed (the cosine
# has barely left its peak there, so a new length moves the lr little)


def fit_length(step: int, seconds_left: float, seconds_per_step: float, cap: int, margin: float) -> int:
    """A schedule length that ends within ``margin`` of the budget left, at the measured
    pace: at least one step past ``step`` and at most ``cap`` (both trainers' re-plans; they
    differ in how they measure the pace and when they re-plan)."""
    return max(step + 1, min(cap, step + int(margin * seconds_left / seconds_per_step)))


class BudgetedLoop:
    progress_desc = "train"

    def train(self, *, minutes: float | None = None, max_steps: int | None = None, steps: int | None = None) -> dict:
        """Train until ``max_steps`` (default cfg.max_steps) or the time budget; a budget
        fixes the schedule's length after 10 measured steps, re-plans it over the first
        quarter of the budget (the length is kept on resume) and stops the call past 1.1x
        the budget even if steps got slower than measured.  ``steps`` stops this call after
        that many steps (the schedule is unchanged: resume later)."""
        from tqdm.auto import tqdm

        cap = max_steps or self.cfg.max_steps
        if self.total_steps is None and minutes is None:
            self.total_steps = cap
        budget = None if minutes is None else minutes * 60.0
        bar = tqdm(
            total=self.total_steps or cap,
            initial=self.step,
            desc=self.progress_desc,
            unit="step",
            disable=not self.progress,
        )
        start = time.perf_counter()
        last_ckpt = start
        measured_from = None
        planned_here = False  # a length from a checkpoint (resume) is kept as it is
        stop = None if steps is None else self.step + steps
        while self.step < (self.total_steps or cap) and (stop is None or self.step < stop):
            loss = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            now = time.perf_counter()
            if budget is not None and (self.total_steps is None or planned_here):
                if measured_from is None and self.step >= 3:
                    measured_from = (self.step, now)
                elif measured_from is not None and (
                    (self.total_steps is None and self.step >= measured_from[0] + 10)
                    or (self.step % REPLAN_EVERY == 0 and now - start < REPLAN_FRACTION * budget)
                ):
                    per_step = (now - measured_from[1]) / (self.step - measured_from[0])
                    left = budget - (now - start)
                    self.total_steps = fit_length(self.step, left, per_step, cap, 0.97)
                    planned_here = True
                    bar.total = self.total_steps
                    bar.refresh()
            if budget is not None and now - start > 1.1 * budget:
                # steps got slower than measured (a shared machine): keep the budget, cut the
                # schedule short (the log records where)
                self.log[-1]["stopped_by_budget"] = True
                break
            if self.step % self.cfg.eval_every == 0:
                self.evaluate()
            if now - last_ckpt > self.cfg.checkpoint_every_s:
                self.wall_s += now - last_ckpt
                last_ckpt = now
                self.save_checkpoint()
        bar.close()
        self.wall_s += time.perf_counter() - last_ckpt
        if not self.evals or self.evals[-1]["step"] != self.step:
            self.evaluate()
        self.save_checkpoint()
        return {"step": self.step, "heldout_loss": self.evals[-1]["heldout_loss"], "wall_s": self.wall_s}
