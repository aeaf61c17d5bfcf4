"""What keeps growing, step by step (tests/workers/step_leaks.py, tests/workers/shard_adamw.py)."""

import collections
import gc


def kinds() -> collections.Counter:
    """How many objects of each kind gc tracks, after a collection. (A dict or list of numbers
    and strings alone is not tracked, so not counted.)"""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def grown(step, stretch: int = 3) -> tuple[dict, int]:
    """Call step() for two stretches of `stretch` calls: the kinds that grew by `stretch` or more
    in both (a step's own objects come and go, their number moving a little either way; a thing
    kept every step grows every time), as {kind: (growth, growth)}, and the most any kind moved
    from the first count to the last."""
    counts = [kinds(), kinds()]  # (each count sees the Counter of the count before it)
    for _ in range(2):
        for _ in range(stretch):
            step()
        counts.append(kinds())
    before, middle, after = counts[1:]
    found = {k: (middle[k] - before[k], after[k] - middle[k]) for k in after
             if middle[k] - before[k] >= stretch and after[k] - middle[k] >= stretch}
    moved = max(abs(after[k] - before[k]) for k in set(after) | set(before))
    return found, moved
