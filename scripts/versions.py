"""Prints the versions of the packages ftq depends on most, so a test log says what it tested."""

from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("torch", "transformers", "peft", "tokenizers", "fastapi", "pydantic", "sqlalchemy", "celery")


def main() -> None:
    for name in PACKAGES:
        try:
            found = version(name)
        except PackageNotFoundError:
            found = "not installed"
        print(f"{name:>13} {found}")


if __name__ == "__main__":
    main()
