"""What the tests share and are not tests themselves: the sandboxed environment, fixtures, the toy modules, the
shared tiny runs, the fault-injection wrapper and pytest plugins (tests/conftest.py registers them).

Nothing here imports a test module (``test_*.py``) and no test module imports another: what two test modules
both need lives here.
"""
