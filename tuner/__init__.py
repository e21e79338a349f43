"""Propose and pick configs: strategies behind one ask/tell interface, sessions, and the results DB."""
