"""Placeholder: replaced by the module owner."""


def train_student() -> None:
    """Not built yet."""
    print("not built yet")
