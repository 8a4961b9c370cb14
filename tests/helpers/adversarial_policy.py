"""A scheduling policy whose every decision is random (seeded): the scheduler's invariants must
hold whatever a policy returns. ``calm = True`` turns it into FCFS with acceptance, so a test can
drain the queue (liveness under a policy that keeps deferring is the policy's business)."""

from __future__ import annotations

import random

from paged.core.policy import Admission, BasePolicy, BudgetSplit


class AdversarialPolicy(BasePolicy):
    name = "adversarial"
    dynamic = True
    uses_prefix_hits = True

    def __init__(self, seed: int) -> None:
        super().__init__(None)
        self.rng = random.Random(seed)
        self.displaces_running = True
        self.calm = False
        self.mutation_attempts = self.mutation_errors = 0

    def sort_key(self, request, now):
        if self.calm:
            return (request.arrival_time,)
        return (self.rng.choice([-1e9, 0, 1, 1e9, self.rng.random()]), self.rng.random())

    def select_victim(self, candidates):
        pick = self.rng.random()
        if pick < 0.1:
            return object()  # not a candidate: the scheduler must fall back
        return self.rng.choice(list(candidates))

    def admit(self, request, now):
        if self.calm:
            return Admission.ACCEPT
        pick = self.rng.random()
        if pick < 0.15:
            return Admission.reject("random rejection", self.rng.choice([429, 503]))
        if pick < 0.35:
            return Admission.defer("random deferral")
        if pick < 0.4:
            return "garbage"  # not an Admission: treated as accept
        return Admission.ACCEPT

    def split_budget(self, state):
        if self.calm or self.rng.random() < 0.2:
            return None
        values = [None, -5, 0, 1, 2, 3, 10**9]
        return BudgetSplit(self.rng.choice(values), self.rng.choice(values))

    def on_step(self, stats):
        for view, _, _ in stats.scheduled:
            for name in ("num_computed_tokens", "sort_key", "num_prompt_tokens"):
                self.mutation_attempts += 1
                try:
                    setattr(view, name, 0)
                except AttributeError:
                    self.mutation_errors += 1


class AdversarialGroupedPolicy(AdversarialPolicy):
    """The same with a grouped waiting queue (``waiting_group``): random groups, a random order
    within them that the random keys do not follow, a random window."""

    name = "adversarial-grouped"

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.waiting_window = self.rng.choice([1, 2, 3])

    def waiting_group(self, request):
        if self.calm:
            return None, (request.arrival_time,)
        return self.rng.choice("abc"), (self.rng.choice([0, 1, self.rng.random()]),)
