"""Stand-ins for actor endpoints, for tests that intercept a call on its way."""


class ActorWith:
    """The real actor mesh (router or trainer), with the endpoints given by name replaced."""

    def __init__(self, actor, **endpoints):
        self._actor = actor
        self.__dict__.update(endpoints)

    def __getattr__(self, name):
        return getattr(self._actor, name)


class Rank0:
    """A whole-mesh call's result with one point (what `first_value` reads)."""

    extent = {"gpus": 1}

    def __init__(self, value):
        self.value = value

    def item(self, **_):
        return self.value


class SlurmJobEndingLate:
    """Stands in for rlactors.procs.slurm.SlurmJob: a job whose squeue says that it ended only from
    the `answers`-th question on (None before: still running, or slurmctld too busy to tell);
    never, with `answers` None."""

    def __init__(self, answers: int | None):
        self.answers, self.asked = answers, 0

    def ended(self):
        self.asked += 1
        return "the Slurm job 7 ended: CANCELLED" if self.answers and self.asked >= self.answers else None
