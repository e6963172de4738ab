"""One module per command: its arguments (``add``), and what it does (``run``), in the order ``--help`` lists them."""
