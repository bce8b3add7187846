"""The ``/ui`` page (``index.html``): a live view of the runs for a person, with no outside
assets; served by :mod:`app.api.ui`."""
