"""`announcing`: the push's word to the replicas (`GroupWords.say` in the controller's process)
announcing another weights version than the trainer broadcasts. The checksum travels with the
broadcast, so the corruption a test can make from outside the procs is the expected version."""

from collections.abc import Callable

from rlactors.weight_sync.broadcast import GroupWords


def announcing(other_version: Callable[[int], int]):
    """A `GroupWords.say` whose words that start a broadcast announce `other_version(version)`."""
    say = GroupWords.say

    def announce(self, keys, word):
        if keys[0].startswith("go/"):
            version, mode = word.split()
            word = f"{other_version(int(version))} {mode}"
        say(self, keys, word)
    return announce
