"""BudgetedLoop: the schedule's length under a time budget, on a simulated clock."""

from types import SimpleNamespace

import pytest

from dspec.train import loop as loop_mod
from dspec.train.loop import BudgetedLoop


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _FakeTrainer(BudgetedLoop):
    """Each step advances the clock by ``pace(step)`` seconds."""

    def __init__(self, clock, pace, total_steps=None):
        self.cfg = SimpleNamespace(max_steps=100_000, eval_every=10**9, checkpoint_every_s=10**9)
        self.step, self.total_steps, self.wall_s = 0, total_steps, 0.0
        self.log, self.evals, self.progress = [], [], False
        self.clock, self.pace = clock, pace

    def train_step(self):
        self.clock.t += self.pace(self.step)
        self.step += 1
        self.log.append({"step": self.step})
        return 1.0

    def evaluate(self):
        self.evals.append({"step": self.step, "heldout_loss": 0.0})

    def save_checkpoint(self):
        pass


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(loop_mod.time, "perf_counter", c)
    return c


def test_budget_fills_when_the_first_steps_are_slow(clock):
    # 1 s per step for the first 100 steps (a cold feature cache), then 0.5 s: a length fixed
    # after 10 steps plans ~3500 steps for an hour; the re-plans must use the budget
    t = _FakeTrainer(clock, lambda s: 1.0 if s < 100 else 0.5)
    t.train(minutes=60)
    assert clock.t <= 1.1 * 3600
    assert clock.t >= 0.9 * 3600, f"stopped at {clock.t:.0f} s of a 3600 s budget"
    assert t.step == t.total_steps


def test_steady_pace_keeps_the_plan_inside_the_budget(clock):
    t = _FakeTrainer(clock, lambda s: 0.25)
    t.train(minutes=10)
    assert 0.9 * 600 <= clock.t <= 600
    assert t.step == t.total_steps and not t.log[-1].get("stopped_by_budget")


def test_a_resumed_length_is_not_re_planned(clock):
    t = _FakeTrainer(clock, lambda s: 0.1, total_steps=500)
    t.train(minutes=60)
    assert t.total_steps == 500 and t.step == 500


def test_no_budget_runs_max_steps(clock):
    t = _FakeTrainer(clock, lambda s: 1.0)
    t.train(max_steps=40)
    assert t.step == t.total_steps == 40
