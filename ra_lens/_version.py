"""The release number, on the ground floor: the package, its build and the circuit page read it."""

__version__ = "0.2.0"
