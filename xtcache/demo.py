"""Placeholder: replaced by the module owner."""


def demo() -> None:
    """Not built yet."""
    print("not built yet")
