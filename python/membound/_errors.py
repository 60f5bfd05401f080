"""membound's typed errors, as Python exceptions with the C++ errors' fields."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """An argument was malformed; nothing was changed.

    argument: which argument; expected: what it must be; got: what it was; todo: what to do.
    """

    def __init__(self, message: str, argument: str, expected: str, got: str, todo: str) -> None:
        super().__init__(message)
        self.argument = argument
        self.expected = expected
        self.got = got
        self.todo = todo


class BudgetTooSmall(InvalidArgument):
    """No plan fits the budget; minimum is the least budget any plan needs, in bytes."""

    def __init__(self, message: str, argument: str, expected: str, got: str, todo: str,
                 budget: int, minimum: int) -> None:
        super().__init__(message, argument, expected, got, todo)
        self.budget = budget
        self.minimum = minimum


class OutOfMemory(MemoryError):
    """An allocation failed; requested is the size of the request that did, in bytes."""

    def __init__(self, message: str, requested: int) -> None:
        super().__init__(message)
        self.requested = requested


def invalid(argument: str, expected: str, got: object, todo: str) -> InvalidArgument:
    """An InvalidArgument worded as the C++ library words its own."""
    shown = repr(got)
    message = f"membound: invalid argument '{argument}': expected {expected}, got {shown}. {todo}"
    return InvalidArgument(message, argument, expected, shown, todo)
