"""Placeholder: replaced by the module owner."""


def inspect() -> None:
    """Not built yet."""
    print("not built yet")


def verify() -> None:
    """Not built yet."""
    print("not built yet")


def cache_ls() -> None:
    """Not built yet."""
    print("not built yet")
