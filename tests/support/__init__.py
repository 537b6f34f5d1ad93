"""Helpers shared by test files: imported as ``support.<module>`` (tests/ is on sys.path under
pytest, as the directory of the root conftest.py). Nothing here is collected as a test."""
