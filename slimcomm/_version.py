"""The slimcomm version, in one place (read by setup.py and compiled into the extension)."""

__version__ = "0.1.0"
