"""Placeholder: replaced by the module owner."""
import typer

app = typer.Typer(help="Student->teacher projection maps.", no_args_is_help=True)


@app.command("build")
def build() -> None:
    """Not built yet."""
    print("not built yet")
