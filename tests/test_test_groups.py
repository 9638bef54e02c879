"""The suite's own machinery: tests that share a machine-wide resource (the test Slurm)
or an expensive module fixture name one ``xdist_group``, and ``--dist loadgroup`` must
send each group to one worker. pytest 9.2.0 with pytest-xdist 3.6.1 silently dropped
the groups (pytest-xdist#1386: xdist marks a group in the test's node id, which pytest
9.2 no longer lets it change), so two test Slurms could run at once."""
import pytest


@pytest.mark.xdist_group("grouping_check")
def test_an_xdist_group_reaches_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@grouping_check"), (
        f"{request.node.nodeid}: the xdist_group mark did not reach the scheduler "
        f"(pytest {pytest.__version__}); pin a pytest that pytest-xdist's loadgroup works with")
