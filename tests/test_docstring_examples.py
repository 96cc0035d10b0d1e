"""The runnable examples in the public ops' docstrings run and print what they say."""

import doctest

import ditops.ops


def test_every_public_op_has_an_example_that_runs():
    finder = doctest.DocTestFinder()
    tests = {test.name.rsplit(".", 1)[-1]: test for test in finder.find(ditops.ops) if test.examples}
    assert set(ditops.ops.PUBLIC) <= set(tests), f"no example: {sorted(set(ditops.ops.PUBLIC) - set(tests))}"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for name in ditops.ops.PUBLIC:
        runner.run(tests[name])
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed (output above)"
