"""The HTTP API (FastAPI): ``runlane.http.app.create_app(lane)``, served by
``runlane serve`` (``runlane.http.serve``). Nothing is imported here, so that the CLI
starts without loading the web stack."""
