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
