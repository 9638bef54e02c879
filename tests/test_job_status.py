"""kvstore/job_status.py in process: what the scheduler writes is what the launcher reads,
and a file of another form is refused, not trusted."""
import json

import pytest

from ssdsgd.kvstore import job_status


def test_written_status_reads_back(tmp_path):
    path = tmp_path / "status.json"
    job_status.write(str(path), started=True, workers=[1, 0], finished=[1], abort=None)
    assert job_status.read(str(path)) == {"started": True, "workers": [0, 1],
                                          "finished": [1], "abort": None}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    job_status.write(str(path), started=True, workers=[0], finished=[], replaced={0: 1})
    assert job_status.read(str(path))["replaced"] == [[0, 1]]     # server 0 -> its backup
    job_status.write(str(path), started=True, workers=[0, 1], finished=[], pushed={1, 0})
    assert job_status.read(str(path))["pushed"] == [0, 1]   # workers known to have pushed


def test_no_file_is_no_record(tmp_path):
    assert job_status.read(str(tmp_path / "none.json")) is None


@pytest.mark.parametrize("data", [[], {"started": "yes", "workers": [], "finished": [],
                                       "abort": None},
                                  {"started": False, "workers": ["0"], "finished": [],
                                   "abort": None},
                                  {"started": False, "workers": [True], "finished": [],
                                   "abort": None},
                                  {"started": True, "workers": [], "finished": [],
                                   "abort": None, "replaced": [[0, "1"]]},
                                  {"started": True, "workers": [], "finished": [],
                                   "abort": None, "replaced": [0, 1]},
                                  {"started": True, "workers": [], "finished": [],
                                   "abort": None, "pushed": ["0"]},
                                  {"started": True, "workers": [], "finished": [],
                                   "abort": None, "pushed": 0}])
def test_a_file_of_another_form_is_refused(tmp_path, data):
    path = tmp_path / "status.json"
    path.write_text(json.dumps(data))
    with pytest.raises(job_status.StatusError):
        job_status.read(str(path))


def test_the_nodes_a_launcher_saw_die_reach_the_scheduler_of_that_restart_only(tmp_path):
    path = str(tmp_path / "status.json")
    assert job_status.read_lost(path, 1) == ([], [])         # nothing written yet
    job_status.write_lost(path, 1, {2, 0}, [3])
    assert job_status.read_lost(path, 1) == ([0, 2], [3])
    assert job_status.read_lost(path, 2) == ([], [])         # another restart's word
    for bad in ("[0]", '{"restart": 1, "lost": [-1]}', '{"restart": 1, "lost": [true]}',
                '{"restart": 1, "lost": "0"}', '{"restart": 1, "lost": [], "workers": ["1"]}',
                "not json"):
        (tmp_path / "status.json.servers-lost").write_text(bad)
        assert job_status.read_lost(path, 1) == ([], []), bad
