"""Test-session order: the long multi-process tests (marked ``slow``) start first.

Under ``pytest -n auto --dist worksteal`` (the README's command) each worker takes half of the
collection in order and an idle worker steals from the end of the other's queue; with the long runs
at the front, the short tests are what is left to steal at the end, so no worker waits behind one
long run started late."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the order is kept otherwise
