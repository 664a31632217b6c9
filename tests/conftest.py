"""Test-session order: the long tests (marked ``slow``) start first, the longest of them (the
torchtitan trainer runs and the demo's torchrun runs, minutes each on 2 cores) before the others.

Under ``pytest -n auto --dist worksteal`` (the README's command) each worker takes half of the
collection in order and an idle worker steals from the end of the other's queue; with the long runs
at the front, the short tests are what is left to steal at the end, so no worker waits behind one
long run started late."""

LONGEST = ("test_torchtitan.py", "test_demo.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        if item.get_closest_marker("slow") is None:
            return 2
        return 0 if item.path.name in LONGEST else 1

    items.sort(key=rank)  # stable: the order is kept otherwise
