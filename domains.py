"""The values each config field takes, stated next to its default in the field's type:

    group_size: Annotated[int, domains.Range(2)] = 8  # G: responses sampled per prompt

config.validate checks every field against its domain before any model loads, with one line
that names the field, the value, what it must be and the default; tests/test_config.py walks the
config tree and tries values outside each domain (`outside`), so a field without a domain, or a
domain whose check is gone, fails there. Checks across fields (batch divisibility, lengths) and
of the model's own properties (positions, KV cache, chat template) are each section's own: its
dataclass's `check` and `check_model`, which config.py walks; they raise `BadInput` (`need`).

A leaf module: every section's dataclass imports it, and it imports nothing of the project.
"""

import math
import numbers


class BadInput(ValueError):
    """The user's config, data or reward plugin is wrong, found by our own checks before any model
    loads. main() prints it as one line and exits 2; elsewhere (a notebook) it is a ValueError
    like any. Only our checks raise it: an exception from inside another library surfaces as it
    is, with its traceback. (config.BadInput is this class: config.py raises it too.)"""


def need(ok, msg: str) -> None:
    """A section's rule across fields: BadInput "config: msg" (the field, its value, the fix)
    where `ok` is false."""
    if not ok:
        raise BadInput(f"config: {msg}")


class Domain:
    def describe(self) -> str:
        """What the field takes, for `--help` ("must be >= 2", "one of a, b")."""
        raise NotImplementedError

    def problem(self, value) -> str | None:
        """None when `value` is in the domain, else what it must be ("must be >= 2")."""
        raise NotImplementedError

    def outside(self) -> list:
        """Values of the field's type that lie outside the domain (for the tree-walking test)."""
        raise NotImplementedError


class Range(Domain):
    """A finite number in [lo, hi] (None: unbounded; open=True: that end excluded)."""

    def __init__(self, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi}")
        return "must be " + " and ".join(parts or ["a finite number"])

    def problem(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
                value):
            return self.describe()
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return self.describe() if low or high else None

    def outside(self) -> list:
        """For an int field the caller keeps the integers of these."""
        out = []
        if self.lo is not None:
            out += [self.lo if self.lo_open else self.lo - 1, self.lo - 1000]
        if self.hi is not None:
            out += [self.hi if self.hi_open else self.hi + 1, self.hi * 1000 + 1000]
        return out + [math.inf, math.nan]


class OneOf(Domain):
    """One of the options (names, or numbers)."""

    def __init__(self, *options):
        self.options = options

    def describe(self) -> str:
        return f"one of {', '.join(repr(o) if o == '' else str(o) for o in self.options)}"

    def problem(self, value):
        return None if value in self.options else f"use {self.describe()}"

    def outside(self) -> list:
        if all(isinstance(o, int) for o in self.options):
            return [min(self.options) - 1, max(self.options) + 1]
        return ["nope", str(self.options[0]).upper() + "x"]


class Items(Domain):
    """A list whose every item is in `item`."""

    def __init__(self, item: Domain):
        self.item = item

    def describe(self) -> str:
        return f"a list, each item {self.item.describe()}"

    def problem(self, value):
        for i, v in enumerate(value):
            if (p := self.item.problem(v)) is not None:
                return f"item {i} ({v!r}): {p}"
        return None

    def outside(self) -> list:
        return [[v] for v in self.item.outside()]


class Anything(Domain):
    """Every value of the field's type is taken here: `why` says where it is checked, if
    anywhere (a later check that names the field: give it values to refuse in `refused`)."""

    def __init__(self, why: str, refused: tuple = ()):
        self.why, self.refused = why, list(refused)

    def describe(self) -> str:
        return self.why

    def problem(self, value):
        return None

    def outside(self) -> list:
        return self.refused


FLAG = Anything("true or false")
DTYPE = OneOf("float32", "bfloat16", "float16")
