"""The last module of a fork server's preload (`TRAINER_PRELOAD`, tests/dist/harness.py): `gc.freeze()`
takes what the preload imported out of the collector's reach, so that a forked rank's collections
neither walk those objects nor copy their pages (a tiny run's rank copied half as many pages)."""

import gc

gc.freeze()
