"""The soak runner of both releases' CP cache state machines:
``python -m tests.soak`` (``make soak``); see :mod:`tests.soak.__main__`."""
