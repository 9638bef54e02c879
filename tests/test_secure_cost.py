"""bench/secure_cost.py runs each way of protecting a connection between real processes
and reports figures that follow from what moved (a small run: 2 MB a round)."""
import pytest

from bench import secure_cost

pytestmark = pytest.mark.system


def test_every_mode_moves_its_rounds_and_reports_its_cost(capsys):
    args = secure_cost.parse_args(["--mb", "2", "--reps", "1", "--message-mb", "0.5",
                                   "--modes", "plain,curve"])
    figures = {mode: secure_cost.run_mode(mode, args) for mode in args.modes}
    for mode, f in figures.items():
        assert f["gbps"] > 0, mode
        assert f["server_cpu_s_per_gb"] > 0 and f["worker_cpu_s_per_gb"] > 0, mode
    assert secure_cost.table(figures, args).splitlines()[2].split()[2] == "1.00"


def test_page_faults_per_gb_follow_the_message_size_and_the_allocator():
    """A received message over glibc's 32 MB mapping ceiling lands in fresh pages, one
    fault per 4 KB page received; 4 MB messages with the allocator keeping what is freed
    (plain-keep) land in pages already touched."""
    pages_per_gb_moved = 1e9 / 2 / 4096          # half of what moves is received
    big = secure_cost.parse_args(["--mb", "80", "--reps", "2", "--message-mb", "40",
                                  "--workers", "1", "--modes", "plain"])
    f = secure_cost.run_mode("plain", big)
    assert f["server_faults_per_gb"] > 0.8 * pages_per_gb_moved, f
    assert f["worker_faults_per_gb"] > 0.8 * pages_per_gb_moved, f
    small = secure_cost.parse_args(["--mb", "80", "--reps", "2", "--message-mb", "4",
                                    "--workers", "1", "--modes", "plain-keep"])
    f = secure_cost.run_mode("plain-keep", small)
    assert f["server_faults_per_gb"] < 0.25 * pages_per_gb_moved, f
    assert f["worker_faults_per_gb"] < 0.25 * pages_per_gb_moved, f


def test_aes_gcm_refuses_a_changed_byte():
    import numpy as np
    from cryptography.exceptions import InvalidTag
    key = bytes(range(32))
    sealed = []
    secure_cost.Sealer(key, reuse=False).seal(np.arange(64, dtype=np.uint8),
                                              lambda buf: sealed.append(buf))
    assert bytes(secure_cost.Sealer(key, reuse=False).open(sealed[0])) == bytes(range(64))
    sealed[0][3] ^= 1
    with pytest.raises(InvalidTag):
        secure_cost.Sealer(key, reuse=False).open(sealed[0])


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(SystemExit):
        secure_cost.parse_args(["--modes", "plain,rot13"])
