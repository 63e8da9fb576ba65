"""Train a classifier through the parameter server: 2 shards, 3 worker processes.

    python examples/ps_train.py                         # tcp:// on loopback
    python examples/ps_train.py --url ucx://127.0.0.1:0 --consistency ssp --staleness 2

The program is ``tensorwire/demo.py`` (``tensorwire demo`` runs the same):
it ships inside the package so that the demo runs from an installed wheel.
Read it there; this file only starts it.
"""

from tensorwire.demo import main

if __name__ == "__main__":
    main()
