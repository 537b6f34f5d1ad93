"""code_tests: the policy writes Python functions, run against tests in a sandbox (env.py)."""
