"""The ftq HTTP API (FastAPI): ``create_app()`` builds it; see ``api.app``."""
