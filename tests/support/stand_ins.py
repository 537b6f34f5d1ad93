"""Stand-ins for actor endpoints, for tests that intercept a call on its way."""


class ActorWith:
    """The real actor mesh (router or trainer), with the endpoints given by name replaced."""

    def __init__(self, actor, **endpoints):
        self._actor = actor
        self.__dict__.update(endpoints)

    def __getattr__(self, name):
        return getattr(self._actor, name)
