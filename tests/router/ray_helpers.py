"""A point function for the Ray tests (module-level: Ray ships it by reference)."""


def square_unless_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is refused")
    return x * x
